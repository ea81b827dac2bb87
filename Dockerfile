# eagle3-pipeline on NVIDIA GPUs. Every Python package comes from locks/cuda.txt (`make lock`:
# exact versions, hash-checked, nothing resolved at build time). Its wheels carry CUDA 13.0
# (torch 2.13.0+cu130, cuda-toolkit 13.0.3, cuDNN/NCCL -cu13; kernels for sm_75 to sm_120: Hopper
# sm_90, Blackwell sm_100 and sm_120), so the base is CUDA 13.0 too, and its NVIDIA_REQUIRE_CUDA
# makes the NVIDIA container runtime refuse a driver older than CUDA 13.0 needs (R580).
# tests/unit/test_lock.py keeps this file, the lock and the CPU lock in agreement.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    DVC_NO_ANALYTICS=1 \
    VENV=/opt/venv \
    SKIP_VENV=1 \
    PYTHONPATH=/work/src

# Python 3.12 is the lock's target; a compiler and Python headers for the kernels Triton and
# FlashInfer build at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev git make build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv

WORKDIR /opt/eagle3
# The build backend first (hash-checked), so the lock's one sdist builds with it, not with an
# unpinned setuptools; then the lock, every package by hash, no dependency resolution.
COPY locks/build.txt locks/cuda.txt locks/
RUN pip install --no-deps --require-hashes -r locks/build.txt \
    && pip install --no-deps --require-hashes --no-build-isolation -r locks/cuda.txt
COPY pyproject.toml README.md ./
COPY src/ src/
RUN pip install --no-deps --no-build-isolation --no-index .

RUN useradd --create-home --uid 1000 eagle3 \
    && mkdir -p /cache /work \
    && chown -R eagle3:eagle3 /cache /work
USER 1000
WORKDIR /work

# The repo is mounted at /work; `make train`, `make gpu-check`, or any dvc command. PYTHONPATH
# makes the stages run the mounted src/ (the code dvc.yaml hashes), not the copy installed above.
ENTRYPOINT ["make"]
CMD ["train"]
