#!/usr/bin/env bash
# One GPU-machine call running the named sections (e.g. `bash tools/device_suite.sh bi coll`).
# Each section logs to /tmp/res/logs/<section>.log and writes results under /tmp/res/<section>;
# everything comes back as one tarball (the device tool returns few files), log tails on stdout. Build .whl/kb first
# (tools/device_wheels.sh) and carry .whl.
set -uo pipefail
source tools/device_env.sh || { echo "wheel install failed"; exit 1; }
mkdir -p "$OUT" /tmp/res/logs
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)
py=python3
section() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  mkdir -p "/tmp/res/$name"
  echo "== $name ($(date +%T))" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "/tmp/res/logs/$name.log" 2>&1
  echo "   rc=$? ($(date +%T))" | tee -a "$OUT/summary.txt"
}
for s in "$@"; do
  case $s in
    bi)
      section bi-tests 150 $py -m pytest -q -p no:cacheprovider plugins/batch_invariant/tests/test_gpu.py
      section bi-bench 170 $py bench/batch_invariant/run.py --configs all --out /tmp/res/bi-bench ;;
    coll)
      [ "$ngpu" -ge 2 ] || { echo "coll needs 2 GPUs, have $ngpu" >> "$OUT/summary.txt"; continue; }
      section coll-tests 60 $py -m pytest -q -p no:cacheprovider plugins/tp_collectives/tests/test_gpu_two_ranks.py
      section coll-bench 90 torchrun --nproc-per-node 2 bench/collectives/run.py --out /tmp/res/coll-bench
      section coll-tp2 110 torchrun --nproc-per-node 2 bench/collectives/engine_tp2.py --out /tmp/res/coll-tp2 ;;
    mxfp4)
      section mxfp4-tests 200 $py -m pytest -q -p no:cacheprovider -m gpu plugins/quant_mxfp4_rocm/tests
      section mxfp4-bench 150 $py bench/mxfp4/run.py --out /tmp/res/mxfp4-bench ;;
    mxfp4-sweep)
      section mxfp4-sweep 200 $py bench/mxfp4/run.py --configs all --ms 1,4,16,64 --budget 170 \
        --out /tmp/res/mxfp4-sweep ;;
    nvfp4)
      section nvfp4-tests 100 $py -m pytest -q -x -p no:cacheprovider -m gpu plugins/quant_nvfp4/tests
      section nvfp4-bench 200 $py bench/nvfp4/run.py --configs all --rep-ms 15 --out /tmp/res/nvfp4-bench ;;
    mla)
      section mla-tests 100 $py -m pytest -q -x -p no:cacheprovider -m gpu plugins/attn_flashmla/tests
      section mla-bench 170 $py bench/mla_decode/run.py --rep 20 --out /tmp/res/mla-bench ;;
    *) echo "unknown section $s" >> "$OUT/summary.txt" ;;
  esac
done
tar -cf "$OUT/results.tar" -C /tmp/res .
for f in /tmp/res/logs/*.log; do echo "---- $f"; tail -n "${TAIL:-25}" "$f" | cut -c1-300; done
cat "$OUT/summary.txt"
