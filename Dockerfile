# Production image for a CUDA host: TensorRT-LLM (LLM) + TensorRT (DiT estimator) + this service.
# Not built here: the workplace has no Docker engine and the base image cannot be fetched. See README.
#
#   docker build -t cosyvoice-realtime .
#   docker run --gpus all -p 8080:8080 -v /srv/models:/models cosyvoice-realtime
#
# The first start downloads the weights and builds the engines into /models (engines are specific to
# the GPU model and TensorRT version, so they are built on the serving host, once, and reused).
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.0.0
FROM ${TRTLLM_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MODELS_DIR=/models

WORKDIR /opt/realtime
# The base image's torch, tensorrt and tensorrt_llm stay as they are: install our package without
# letting pip replace them.
COPY pyproject.toml README.md ./
COPY engines ./engines
COPY realtime ./realtime
COPY web ./web
COPY scripts ./scripts
RUN python3 -m pip install --no-deps -e . \
 && python3 -m pip install "safetensors>=0.4" "onnx>=1.16" "onnxruntime-gpu>=1.18" "tokenizers>=0.19" \
        "pyyaml>=6" "tqdm>=4.66" "soundfile>=0.12" "huggingface-hub>=0.24" "starlette>=0.37" \
        "uvicorn[standard]>=0.35" "websockets>=14" "uvloop>=0.19" "aiortc>=1.9" "aioice>=0.9,<1" "av>=12" \
        "httpx>=0.27" "prometheus-client>=0.20" "python-multipart>=0.0.9" "protobuf>=4" \
        "wetext>=0.1.8" "inflect>=7"

EXPOSE 8080
VOLUME ["/models"]
# Idempotent: each stage skips when its output exists and is valid.
CMD ["bash", "-c", "python3 scripts/build_engines.py download --out $MODELS_DIR \
 && python3 scripts/build_engines.py convert-hf --models $MODELS_DIR \
 && python3 scripts/build_engines.py build-trtllm --models $MODELS_DIR \
 && python3 scripts/build_engines.py export-onnx --models $MODELS_DIR \
 && python3 scripts/build_engines.py build-trt --models $MODELS_DIR \
 && exec realtime serve --host 0.0.0.0 --port 8080 --models $MODELS_DIR --llm-backend auto --token2wav-backend auto"]
