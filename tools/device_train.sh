#!/usr/bin/env bash
# One device-machine call: check the engine on CUDA, check training determinism, train the
# demo model on the carried CPython 3.11.7 standard library, then run the engine benchmark.
# Everything lands in $OUT as few files (the device tool returns at most 8).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT" /tmp/stdlib
log="$OUT/log.txt"
tar -xzf .corpus/stdlib-3.11.7.tar.gz -C /tmp/stdlib
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$log"
for run in a b; do
  python3 tools/train_demo.py --out /tmp/det_$run --steps 30 --device cuda --corpus /tmp/stdlib 2>&1 | grep -E "step|corpus" >> "$log"
done
python3 - <<'PY' >> "$log"
from safetensors.torch import load_file
a, b = load_file("/tmp/det_a/model.safetensors"), load_file("/tmp/det_b/model.safetensors")
print("deterministic:", all((a[k] == b[k]).all().item() for k in a))
PY
steps=${DEMO_STEPS:-3000}
echo "training for $steps steps" >> "$log"
timeout 360 python3 tools/train_demo.py --out /tmp/demo --steps "$steps" --device cuda --corpus /tmp/stdlib > "$OUT/train.log" 2>&1
tail -3 "$OUT/train.log" >> "$log"
tar -cf "$OUT/demo.tar" -C /tmp demo
timeout 200 python3 bench/engine/run.py --sizes small,medium,large --batches 1,8 --repeats 3 --out "$OUT/engine" >> "$log" 2>&1
cat "$log"
