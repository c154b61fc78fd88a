# Source on the GPU machine (carry .whl): installs the carried third-party wheels and our own
# (tools/device_wheels.sh) into /tmp/site and keeps NVLink multicast off for every program.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .whl/kb/*.whl || return 1
export PYTHONPATH=/tmp/site
