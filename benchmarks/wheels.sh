#!/usr/bin/env bash
# Downloads into .whl/ the wheels (Python 3.12, x86-64 Linux) of the service's packages that the lent GPU
# machine's image lacks, and into .whl-profile/ py-spy (for `benchmarks/startup.py --profile` and
# benchmarks/load_profile.py); benchmarks/on_device.sh installs both there. Both are git-ignored. A device
# call carries at most 64 MiB with the tracked files: .whl/ (~51 MB) goes on every call, .whl-profile/
# (~3 MB) only on the calls that profile.
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    aiortc aioice av cryptography google-crc32c pyee pylibsrtp pyopenssl dnspython ifaddr cffi pycparser \
    websockets starlette uvicorn httptools python-multipart soundfile pytest-asyncio pytest-xdist execnet \
    wetext kaldifst contractions textsearch anyascii pyahocorasick inflect typeguard more-itertools \
    jaraco.functools
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl-profile py-spy
du -sh .whl .whl-profile
