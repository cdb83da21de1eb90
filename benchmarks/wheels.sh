#!/usr/bin/env bash
# Downloads into .whl/ the wheels (Python 3.12, x86-64 Linux) of the service's packages that the lent GPU
# machine's image lacks, and py-spy for `benchmarks/startup.py --profile`; benchmarks/on_device.sh installs them
# there. .whl/ is git-ignored (~54 MB).
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
    websockets starlette uvicorn httptools python-multipart soundfile pytest-asyncio \
    wetext kaldifst contractions textsearch anyascii pyahocorasick inflect typeguard more-itertools \
    jaraco.functools py-spy
du -sh .whl
