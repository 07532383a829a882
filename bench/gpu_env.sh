#!/usr/bin/env bash
# On the GPU machine of this workplace: make SGLang, tyro and $SMOLLM2 available.
#   source bench/gpu_env.sh
# Needs ../shared/gpu's bundle parts copied to /tmp/gpu-bundle (see ../shared/gpu/README.md) and
# the wheels carried in .whl/ (bench/README.md says which and how they were downloaded).
source /tmp/gpu-bundle/p1/install-bundle.sh || return 1
if [ -d .whl ] && [ ! -e /tmp/site-extra/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-extra .whl/*.whl \
    && touch /tmp/site-extra/.done
fi
# sglang.launch_server (the HTTP server, issue 13) imports more than the in-process Engine: .whl-server/
if [ -d .whl-server ] && [ ! -e /tmp/site-server/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-server .whl-server/*.whl \
    && touch /tmp/site-server/.done
fi
export PYTHONPATH=/tmp/site-extra:/tmp/site-server:$PYTHONPATH PYTHONUNBUFFERED=1
export PATH=/tmp/site-extra/bin:$PATH  # py-spy (a sampling profiler, one binary: bench/spy_report.py reads its output)
# The python tool's jail (sandbox.py) needs bubblewrap, which the GPU image lacks: Debian's package, carried in .debs/
# (bench/README.md), unpacked into /tmp/jail-root (not /: other packages there can break it) and put on the PATH.
if ! command -v bwrap >/dev/null && [ -d .debs ]; then
  for f in .debs/*.deb; do dpkg -x "$f" /tmp/jail-root; done
  export PATH=/tmp/jail-root/usr/bin:$PATH
fi
# The image sets PYTHONDONTWRITEBYTECODE=1 and ships no .pyc files: every process (the trainer, SGLang's scheduler and
# detokenizer) compiled torch and SGLang from source, 82-89 s to step 1 instead of 44-46 s (results/README.md, start-up).
unset PYTHONDONTWRITEBYTECODE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
