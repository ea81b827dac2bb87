# eagle3-pipeline on NVIDIA GPUs. Every Python package comes from locks/cuda.txt (`make lock`:
# exact versions, hash-checked, nothing resolved at build time). Its wheels carry CUDA 13.0
# (torch 2.13.0+cu130, cuda-toolkit 13.0.3, cuDNN/NCCL -cu13; torch's kernels for sm_75, sm_80,
# sm_86, sm_90, sm_100 and sm_120 (+PTX): Hopper and Blackwell), so the base is CUDA 13.0 too, and
# its NVIDIA_REQUIRE_CUDA makes the NVIDIA container runtime refuse a driver older than CUDA 13.0
# needs (R580). tests/unit/test_lock.py keeps this file, the lock and the CPU lock in agreement.
#
# -devel, not -base: vLLM compiles kernels at run time with nvcc and the CUDA headers. On sm_90 it
# prefers the Humming kernels over Marlin for Kimi-K2.5's INT4 routed experts
# (quantization/utils/humming/priority.py), and at TP > 1 its default -O2 fuses all-reduce +
# RMSNorm through FlashInfer (config/vllm.py enable_allreduce_rms_fusion); on sm_100 FlashInfer
# comes first for MLA attention and INT4 MoE. Both JIT-compile: FlashInfer finds the toolkit
# through CUDA_HOME, Humming through CUDA_HOME/bin/nvcc and CUDA_HOME/include.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ENV CUDA_HOME=/usr/local/cuda \
    EAGLE3_CACHE=/work/data/.work/cache
# Every compiler and kernel cache, and HOME, in the mounted work tree (git-ignored data/.work/)
# so that `docker run -u <any uid>` can write them and a second run starts warm; HF_HOME is the
# host's Hugging Face cache that `make docker-*` mounts.
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$CUDA_HOME/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HOME=$EAGLE3_CACHE/home \
    XDG_CACHE_HOME=$EAGLE3_CACHE/xdg \
    TRITON_CACHE_DIR=$EAGLE3_CACHE/triton \
    TORCHINDUCTOR_CACHE_DIR=$EAGLE3_CACHE/torchinductor \
    VLLM_CACHE_ROOT=$EAGLE3_CACHE/vllm \
    FLASHINFER_WORKSPACE_BASE=$EAGLE3_CACHE/flashinfer \
    HUMMING_CACHE_DIR=$EAGLE3_CACHE/humming/cache \
    HUMMING_TMP_DIR=$EAGLE3_CACHE/humming/tmp \
    CUDA_CACHE_PATH=$EAGLE3_CACHE/nv \
    DVC_NO_ANALYTICS=1 \
    VENV=/opt/venv \
    SKIP_VENV=1 \
    PYTHONPATH=/work/src

# Python 3.12 is the lock's target; a host compiler and Python headers for the kernels Triton,
# FlashInfer and Humming build at run time (nvcc and the CUDA headers come with the base).
# Mooncake's wheel (train.online.backend: mooncake) loads libibverbs.so.1, libnuma.so.1 and
# libcurl.so.4 from the system even for TCP (curl brings libcurl under its release's package
# name); ibverbs-providers holds the RDMA NICs' drivers (protocol: rdma).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev git make build-essential ca-certificates \
        libibverbs1 ibverbs-providers libnuma1 curl \
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

# Any uid may write where the image points HOME and the caches, also without the mounts.
RUN useradd --no-create-home --uid 1000 eagle3 \
    && mkdir -p /cache/huggingface "$HOME" \
    && chmod -R 1777 /cache /work
USER 1000
WORKDIR /work

# The repo is mounted at /work; `make train`, `make gpu-check`, or any dvc command. PYTHONPATH
# makes the stages run the mounted src/ (the code dvc.yaml hashes), not the copy installed above.
ENTRYPOINT ["make"]
CMD ["train"]
