# ptk in a container image, for clusters that run software from NGC-style images with enroot and
# pyxis. The build steps are the scripts that README and CI run: scripts/install-deps.sh
# --build-only (Debian/Ubuntu packages) and scripts/build.sh (CMake); the CUDA backend is built
# whenever nvcc is in the image (for sm_80 and sm_90; --build-arg CUDA_ARCHS="90" or another list to
# change). The image holds the portable tree (scripts/make-portable.sh) in
# /opt/ptk: its programs carry their own libraries, so the tree can also be copied out of the image
# onto CPU nodes that run no containers.
#
#   docker build -t ptk --build-arg PTK_GIT_COMMIT=$(git rev-parse --short=12 HEAD) .
#                                                          (or podman build; BASE: any Ubuntu 24.04 or
#                                                           Debian 12 image, by default NVIDIA's CUDA 13;
#                                                           the commit is what --version names: .git
#                                                           does not go into the image)
#   enroot import -o ptk.sqsh dockerd://ptk                (an image file for pyxis)
#   srun --container-image=./ptk.sqsh --container-mounts=$STAGE_PATH:$STAGE_PATH ptk-tokenize ...
ARG BASE=nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG RUNTIME_BASE=nvcr.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE} AS build
ARG CUDA_ARCHS="80;90"
ARG PTK_GIT_COMMIT=""
ENV DEBIAN_FRONTEND=noninteractive
COPY . /src/ptk
WORKDIR /src/ptk
RUN bash scripts/install-deps.sh --build-only \
 && bash scripts/build.sh /tmp/ptk-build -DCMAKE_BUILD_TYPE=Release -DPTK_BUILD_TESTS=OFF -DPTK_BUILD_BENCH=OFF \
      "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}" "-DPTK_GIT_COMMIT=${PTK_GIT_COMMIT}" --portable /opt/ptk \
 && rm -rf /tmp/ptk-build

FROM ${RUNTIME_BASE}
COPY --from=build /opt/ptk /opt/ptk
ENV PATH=/opt/ptk/bin:${PATH}
# The Slurm scripts of the image's ptk, with PTK_BIN defaulting to /opt/ptk/bin.
WORKDIR /opt/ptk/share/ptk/slurm
