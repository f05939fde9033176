# vLLM's official OpenAI-compatible server image with the MiniMax M3 FlashInfer
# indexer series applied. Build and run (README.md, "Install"; docs/deploy.md):
#   docker build -t vllm-minimax:0.34.0 .
#   docker build --build-arg VLLM_IMAGE_TAG=v0.33.0 -t vllm-minimax:0.33.0 .
#   docker run --gpus all --ipc=host -p 8000:8000 vllm-minimax:0.34.0 \
#       MiniMaxAI/MiniMax-M3-MXFP8 --config /opt/vllm-minimax/configs/serve/h200-8x.yaml
# The tag picks the vLLM release; docker/build.sh fails the build when that vLLM
# has no series in patches/ or is not the tag's version.
ARG VLLM_IMAGE_TAG=v0.34.0
FROM vllm/vllm-openai:${VLLM_IMAGE_TAG}
ARG VLLM_IMAGE_TAG

COPY . /opt/vllm-minimax

# FlashInfer 0.7.4 over the image's pin (0.7.3; 0.7.2.post1 in v0.33.0), this package, `vllm-minimax apply`,
# and a build failure unless flashinfer.msa_ops imports and `vllm-minimax status` is clean afterwards.
RUN EXPECTED_VLLM_VERSION="${VLLM_IMAGE_TAG#v}" bash /opt/vllm-minimax/docker/build.sh

# FlashInfer's MSA programs of the shipped SM90 configs, built here without a GPU
# (`vllm-minimax warmup --prebuild`: nvcc and FlashInfer's CuTe-DSL compile; docs/warm-start.md)
# into the cache the server reads, so a container compiles none of them at start. Also removes
# the base image's FlashInfer kernel wheels of its own FlashInfer release, which 0.7.4 ignores.
# --build-arg PREBUILD_CONFIGS= skips the programs; PREBUILD_GPUS picks the cards.
ARG PREBUILD_CONFIGS="h100-8x h100-16x-2node h200-8x h200-8x-bf16"
ARG PREBUILD_KV_CACHE_DTYPES="auto fp8"
ARG PREBUILD_GPUS="h100 h200"
ENV FLASHINFER_WORKSPACE_BASE=/opt/flashinfer
# The same step builds Humming's GEMM kernels of MiniMaxAI/MiniMax-M3-MXFP8 (its geometry as this
# package knows it) for each config's TP/EP on each of PREBUILD_GPUS that is h100 or h200 (the
# cards whose device properties it knows), into the cache the server reads. Humming keys a kernel
# by its generated source and flags, the absolute paths and modification times of its installed
# headers, the NVRTC version and CUDA_HOME's include paths: a container of this image finds them
# as it runs the same Humming install and toolkit; a derived image that reinstalls
# humming-kernels, or a run with another CUDA_HOME, builds its own at start. The SM count is in no
# key and compiled into no kernel: it picks the tuning (block shapes, stages: in the source) and
# the launch grid (set on the live GPU). An H100 PCIe (114 SMs) or an H20 tunes for itself, loads
# an image kernel only where it picks the same code, and builds the rest at start.
ENV HUMMING_CACHE_DIR=/opt/humming
RUN PREBUILD_CONFIGS="${PREBUILD_CONFIGS}" PREBUILD_KV_CACHE_DTYPES="${PREBUILD_KV_CACHE_DTYPES}" \
    PREBUILD_GPUS="${PREBUILD_GPUS}" bash /opt/vllm-minimax/docker/prebuild.sh

# No ENTRYPOINT or CMD here: the base image's `vllm serve` entrypoint is kept.
