#!/usr/bin/env bash
# One GPU-machine call running the named sections (e.g. `bash tools/device_suite.sh final`).
# Each section logs to /tmp/res/logs/<section>.log and writes results under /tmp/res/<section>;
# everything comes back as one tarball (the device tool returns few files), log tails on stdout.
# Build .whl/kb first (tools/device_wheels.sh) and carry .whl (and .corpus for training).
set -uo pipefail
source tools/device_env.sh || { echo "wheel install failed"; exit 1; }
mkdir -p "$OUT" /tmp/res/logs
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)
py=python3
section() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  mkdir -p "/tmp/res/$name"
  echo "== $name start $(date +%T) gpu ${CUDA_VISIBLE_DEVICES:-all}" >> "$OUT/summary.txt"
  timeout "$limit" "$@" > "/tmp/res/logs/$name.log" 2>&1
  echo "== $name rc=$? end $(date +%T)" >> "$OUT/summary.txt"
}
kernels_a() {  # quantized weight-only GEMMs and the drafter, one GPU
  section nvfp4-bench 150 $py bench/nvfp4/run.py --configs all --rep-ms 15 --out /tmp/res/nvfp4-bench
  section mla-bench 150 $py bench/mla_decode/run.py --budget-s 70 --out /tmp/res/mla-bench
  section spec-bench 90 $py bench/spec_decode/run.py --device cuda --sweep 1,8,64 --repeats 1 \
    --out /tmp/res/spec-bench
}
kernels_b() {  # MX GEMM, batch-invariant matmul, MLA correctness, one GPU
  section mxfp4-bench 150 $py bench/mxfp4/run.py --configs all --budget 110 --out /tmp/res/mxfp4-bench
  section bi-bench 130 $py bench/batch_invariant/run.py --configs all --budget 90 --out /tmp/res/bi-bench
  section mla-tests 110 $py -m pytest -q -p no:cacheprovider -m gpu plugins/attn_flashmla/tests
}
two_gpus() {
  section coll-bench 60 torchrun --nproc-per-node 2 bench/collectives/run.py --out /tmp/res/coll-bench
  section coll-tp2 110 torchrun --nproc-per-node 2 bench/collectives/engine_tp2.py --out /tmp/res/coll-tp2
}
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n1)
ncu_sections="--section SpeedOfLight --section Occupancy --section LaunchStats
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis
  --section InstructionStats"
prof() {  # name, kernel regex, extra ncu flags..., --, command...: one launch (the fifth) profiled
  local name=$1 kern=$2 flags=()
  shift 2
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  section "prof-$name" 200 "$ncu_bin" --clock-control none -k "regex:$kern" --launch-skip 4 \
    --launch-count 1 $ncu_sections "${flags[@]}" "$@"
}
profile() {  # Nsight Compute on one launch of each kernel the speed targets hinge on
  prof nvfp4-m16 nvfp4_matmul_hw -- $py bench/nvfp4/run.py --shapes 8192x8192 --ms 16 \
    --timer events --rep-ms 2 --out /tmp/res/prof-nv
  prof mxfp4-m16 _mxfp4_gemm_kernel -- $py bench/mxfp4/run.py --shapes 8192x8192 --ms 16 \
    --rep 2 --out /tmp/res/prof-mx
  prof mla-mxfp8 mla_decode_kernel -- $py bench/mla_decode/run.py --batches 64 --contexts 8192 \
    --heads 16 --kinds mxfp8 --eager --rep 2 --no-tune --out /tmp/res/prof-mla
  prof mla-bf16 mla_decode_kernel -- $py bench/mla_decode/run.py --batches 64 --contexts 8192 \
    --heads 16 --kinds bf16 --eager --rep 2 --no-tune --out /tmp/res/prof-mla16
  prof bi-4096-m64 _matmul_kernel -- $py bench/batch_invariant/run.py --shapes 4096x4096 \
    --batches 64 --timer events --out /tmp/res/prof-bi
}
bi_sweep() {
  section bi-bench 200 $py bench/batch_invariant/run.py --configs all --budget "${BI_BUDGET:-150}" \
    --out /tmp/res/bi-bench
}
gpu_tests() {  # the GPU-marked tests of the plugins whose kernels changed since the last run
  section gpu-tests 260 $py -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --durations 12 \
    plugins/quant_nvfp4/tests plugins/batch_invariant/tests plugins/quant_mxfp4_rocm/tests
}
small_m_sweeps() {  # the M <= 16 kernel candidates of the two FP4 weight-only GEMMs
  section nvfp4-bench 110 $py bench/nvfp4/run.py --configs all --rep-ms 10 --ms 1,16 \
    --out /tmp/res/nvfp4-bench
  section mxfp4-bench 110 $py bench/mxfp4/run.py --configs all --ms 1,16 --sweep-ms 16 \
    --budget 80 --out /tmp/res/mxfp4-bench
}
lanes() {  # two commands (function names) side by side on two GPUs, else one after the other
  if [ "$ngpu" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 $1 & CUDA_VISIBLE_DEVICES=1 $2 & wait
  else
    $1; $2
  fi
}
for s in "$@"; do
  case $s in
    profile) profile ;;
    mlacuda)  # the CUDA MXFP8 decode kernel: its GPU tests, then the MLA table with its sweep
      section mla-cuda-tests 200 $py -m pytest -q -p no:cacheprovider -m gpu \
        plugins/attn_flashmla/tests
      section mla-bench 300 $py bench/mla_decode/run.py --budget-s 200 --out /tmp/res/mla-bench ;;
    mlaquick)  # the CUDA decode kernel's tests, then its builds on the memory-bound rows
      section mla-cuda-tests 150 $py -m pytest -q -p no:cacheprovider -m gpu \
        plugins/attn_flashmla/tests/test_cuda_mla.py
      section mla-bench 200 $py bench/mla_decode/run.py --kinds bf16,mxfp8 --heads 16 \
        --contexts 8192,32768 --batches 16,64,128 --sweep cuda --budget-s 150 \
        --out /tmp/res/mla-bench ;;
    mlacudaprof)  # Nsight Compute on the CUDA MXFP8 decode kernel at batch 64, 8k keys, with
      # its stall reasons and their source lines
      prof mla-cuda mla_decode_mx --print-details all --section SourceCounters -- \
        $py bench/mla_decode/run.py --batches 64 --contexts 8192 --heads 16 --kinds mxfp8 \
        --eager --rep 2 --no-tune --out /tmp/res/prof-mla ;;
    bi) bi_sweep ;;
    tp2) two_gpus ;;
    gputests) gpu_tests ;;
    sweeps) small_m_sweeps ;;
    tune)  # candidate sweeps next to the GPU tests, then the engine under TP = 2
      lane_sweeps() { bi_sweep; section nvfp4-bench 110 $py bench/nvfp4/run.py --configs all \
        --rep-ms 10 --ms 1,16 --out /tmp/res/nvfp4-bench; }
      lane_tests() { gpu_tests; section mxfp4-bench 110 $py bench/mxfp4/run.py --configs all \
        --ms 1,16 --sweep-ms 16 --budget 80 --out /tmp/res/mxfp4-bench; }
      lanes lane_sweeps lane_tests
      [ "$ngpu" -ge 2 ] && section coll-tp2 120 torchrun --nproc-per-node 2 \
        bench/collectives/engine_tp2.py --out /tmp/res/coll-tp2 ;;
    confirm)  # the tables as committed: matmul sweep, FP4 benchmarks, GPU tests, TP = 2 engine
      lane_a() { bi_sweep; section nvfp4-bench 100 $py bench/nvfp4/run.py --rep-ms 15 \
        --out /tmp/res/nvfp4-bench; }
      lane_b() {
        section gpu-tests 230 $py -m pytest -v -p no:cacheprovider -m gpu --timeout 150 \
          --durations 8 -k "not split_k_sums" plugins/batch_invariant/tests \
          plugins/quant_mxfp4_rocm/tests
        section mxfp4-bench 100 $py bench/mxfp4/run.py --ms 1,4,16,64,256 --out /tmp/res/mxfp4-bench
      }
      lanes lane_a lane_b
      [ "$ngpu" -ge 2 ] && section coll-tp2 120 torchrun --nproc-per-node 2 \
        bench/collectives/engine_tp2.py --out /tmp/res/coll-tp2 ;;
    nvpairs)  # the NVFP4 word-decode kernels: GPU tests, then the sweep at M = 1, 16, 64
      section nv-tests 170 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 160 \
        plugins/quant_nvfp4/tests/test_nvfp4_triton.py
      section nvfp4-bench 130 $py bench/nvfp4/run.py --configs all --rep-ms 10 --ms 1,16,64 \
        --out /tmp/res/nvfp4-bench ;;
    fp4final)  # the MXFP4 table and sweep with rotated weights, the repacked kernels profiled
      section mxfp4-bench 250 $py bench/mxfp4/run.py --configs all --ms 1,4,16,64,256 \
        --sweep-ms 16,64 --budget 220 --out /tmp/res/mxfp4-bench
      prof nvfp4-m16-pr nvfp4_matmul_hw -- $py bench/nvfp4/run.py --shapes 8192x8192 --ms 16 \
        --timer events --rep-ms 2 --out /tmp/res/prof-nv
      prof mxfp4-m16-pr _mxfp4_gemm_kernel -- $py bench/mxfp4/run.py --shapes 8192x8192 \
        --ms 16 --rep 2 --out /tmp/res/prof-mx ;;
    splits)  # GPU tests of the FP4 kernels, then their M <= 16 sweeps with fixed split counts
      section fp4-gpu-tests 220 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 200 \
        plugins/quant_nvfp4/tests/test_nvfp4_triton.py plugins/quant_mxfp4_rocm/tests/test_triton_kernels.py \
        -k "pr- or every_code or method or repacked or candidate or extremes"
      section nvfp4-bench 150 $py bench/nvfp4/run.py --configs all --rep-ms 8 --ms 1,16 \
        --out /tmp/res/nvfp4-bench
      section mxfp4-bench 150 $py bench/mxfp4/run.py --configs all --ms 1,16 --sweep-ms 1,16 \
        --budget 130 --out /tmp/res/mxfp4-bench ;;
    fragment)  # the NVFP4 fragment-order (swapped wgmma) kernels: GPU tests, then their sweep
      section nv-tests 200 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 190 \
        plugins/quant_nvfp4/tests/test_nvfp4_triton.py -k "pf- or every_code or method"
      section nvfp4-bench 300 $py bench/nvfp4/run.py --rep-ms 8 --ms 1,16,64,256 \
        --configs pf,pr-16x64x256-p3,pr-64x128x128,pr-128x128x64,dequant \
        --out /tmp/res/nvfp4-bench ;;
    fragment2)  # GPU tests of both FP4 plugins' fragment kernels, the NVFP4 table and pf sweep
      section fp4-tests 260 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 250 \
        plugins/quant_nvfp4/tests/test_nvfp4_triton.py plugins/quant_nvfp4/tests/test_nvfp4_fused_moe.py \
        plugins/quant_mxfp4_rocm/tests/test_triton_kernels.py \
        -k "pf- or every_code or method or moe or fragment or pairs_decode or realistic"
      section nvfp4-bench 280 $py bench/nvfp4/run.py --rep-ms 8 --ms 1,4,16,64,256 \
        --configs pf,dequant --out /tmp/res/nvfp4-bench ;;
    mxfrag)  # the MXFP4 fragment decode's GPU tests, then its table and candidate sweep
      section mx-tests 130 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 120 \
        plugins/quant_mxfp4_rocm/tests/test_triton_kernels.py -k "fragment or pairs_decode"
      section mxfp4-bench 330 $py bench/mxfp4/run.py --configs all --ms 1,4,16,64,256 \
        --sweep-ms 1,16,64,256 --budget 270 --out /tmp/res/mxfp4-bench ;;
    fragfinal)  # GPU tests of both FP4 plugins on the fragment defaults, then their tables
      section fp4-tests 230 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 220 \
        plugins/quant_nvfp4/tests/test_nvfp4_triton.py plugins/quant_nvfp4/tests/test_nvfp4_fused_moe.py \
        plugins/quant_mxfp4_rocm/tests/test_triton_kernels.py plugins/quant_mxfp4_rocm/tests/test_triton_methods.py \
        -k "pf- or every_code or method or moe or fragment or pairs_decode or realistic or linear"
      section nvfp4-bench 120 $py bench/nvfp4/run.py --rep-ms 15 --ms 1,4,16,64,256 \
        --out /tmp/res/nvfp4-bench
      section mxfp4-bench 130 $py bench/mxfp4/run.py --ms 1,4,16,64,256 --out /tmp/res/mxfp4-bench ;;
    fragprof)  # Nsight Compute on the fragment defaults of both FP4 GEMMs (M = 16)
      prof nvfp4-m16-fragment nvfp4_matmul_hw -- $py bench/nvfp4/run.py --shapes 8192x8192 \
        --ms 16 --timer events --rep-ms 2 --out /tmp/res/prof-nv
      prof mxfp4-m16-fragment _mxfp4_gemm_kernel -- $py bench/mxfp4/run.py \
        --shapes 8192x8192 --ms 16 --rep 2 --out /tmp/res/prof-mx ;;
    fp4gpu)  # every GPU test of the two FP4 plugins
      section fp4-gpu 330 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 320 \
        plugins/quant_nvfp4/tests plugins/quant_mxfp4_rocm/tests ;;
    fp4tables)  # the two FP4 GEMMs' committed tables
      section nvfp4-bench 150 $py bench/nvfp4/run.py --rep-ms 15 --ms 1,4,16,64,256 \
        --out /tmp/res/nvfp4-bench
      section mxfp4-bench 150 $py bench/mxfp4/run.py --ms 1,4,16,64,256 --out /tmp/res/mxfp4-bench ;;
    mlanew)  # MLA GPU tests, then the decode table with its config and split sweeps
      section mla-tests 150 $py -m pytest -q -p no:cacheprovider -m gpu plugins/attn_flashmla/tests
      section mla-bench 300 $py bench/mla_decode/run.py --budget-s 220 --out /tmp/res/mla-bench ;;
    mlafinal)  # the MLA decode table, then both record kinds' kernels in Nsight Compute
      section mla-bench 200 $py bench/mla_decode/run.py --budget-s 120 --out /tmp/res/mla-bench
      prof mla-mxfp8-split-model mla_decode_kernel --print-details all -- \
        $py bench/mla_decode/run.py --batches 64 --contexts 8192 --heads 16 --kinds mxfp8 \
        --eager --rep 2 --no-tune --out /tmp/res/prof-mla
      prof mla-bf16-split-model mla_decode_kernel --print-details all -- \
        $py bench/mla_decode/run.py --batches 64 --contexts 8192 --heads 16 --kinds bf16 \
        --eager --rep 2 --no-tune --out /tmp/res/prof-mla16 ;;
    mlalast)  # MLA GPU tests, the decode table, the MXFP8 kernel in Nsight Compute
      section mla-tests 150 $py -m pytest -q -p no:cacheprovider -m gpu plugins/attn_flashmla/tests
      section mla-bench 200 $py bench/mla_decode/run.py --budget-s 120 --out /tmp/res/mla-bench
      prof mla-mxfp8-tiles mla_decode_kernel --print-details all -- \
        $py bench/mla_decode/run.py --batches 64 --contexts 8192 --heads 16 --kinds mxfp8 \
        --eager --rep 2 --no-tune --out /tmp/res/prof-mla ;;
    refgpu)  # after a core reference change: the core's and NVFP4's GPU tests
      section core-gpu 60 $py -m pytest -q -p no:cacheprovider -m gpu core/tests
      section nv-gpu 300 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 290 \
        plugins/quant_nvfp4/tests ;;
    cugemv)  # the NVFP4 CUDA GEMV and the tiles layout: GPU tests, then the sweep over M
      section cu-tests 220 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 210 \
        plugins/quant_nvfp4/tests/test_nvfp4_cuda_gemv.py plugins/quant_nvfp4/tests/test_nvfp4_triton.py \
        plugins/quant_nvfp4/tests/test_nvfp4_fused_moe.py \
        -k "cuda_gemv or ct-default or pt-16x64x256-p3 or pt-64x128x128-w8 or pt-128x128x128-w8 or method or every_code or moe"
      section nvfp4-bench 240 $py bench/nvfp4/run.py --rep-ms 8 --ms 1,4,8,16,64,256 \
        --configs pt-16x64x256-p3,pt-64x128x128-w8,pt-128x128x128-w8,pt-64x64x256,pf-16x64x256-p3,pf-64x128x128-w8,pf-128x128x128-w8,ct-t2w1x4s4b4,ct-t2w1x8s4b2,ct-t4w1x8s4b1,ct-t4w1x4s4b2 \
        --out /tmp/res/nvfp4-bench ;;
    nvfinal)  # every NVFP4 GPU test, then the committed table
      section nv-gpu 250 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 240 -k "not hw- and not pw- and not pr-" \
        plugins/quant_nvfp4/tests
      section nvfp4-bench 120 $py bench/nvfp4/run.py --rep-ms 15 --ms 1,4,8,16,64,256 \
        --out /tmp/res/nvfp4-bench ;;
    tilesbig)  # the fragment kernels on both layouts at M >= 16
      section nvfp4-bench 200 $py bench/nvfp4/run.py --rep-ms 8 --ms 16,64,256 \
        --configs pt-16x64x256-p3,pt-64x128x128-w8,pt-128x128x128-w8,pf-16x64x256-p3,pf-64x128x128-w8,pf-128x128x128-w8 \
        --out /tmp/res/nvfp4-bench ;;
    tilesprof)  # the M = 64 fragment kernel on both layouts in Nsight Compute
      prof pt-m64 nvfp4_matmul_hw -- $py bench/nvfp4/one_config.py pt-64x128x128-w8 8192 8192 64
      prof pf-m64 nvfp4_matmul_hw -- $py bench/nvfp4/one_config.py pf-64x128x128-w8 8192 8192 64 ;;
    mxgpu)  # every GPU test of the MXFP4 plugin
      section mx-gpu 330 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 320 \
        plugins/quant_mxfp4_rocm/tests ;;
    mlaprof)  # the MXFP8 MLA decode kernel in detail: stall reasons and where they happen
      prof mla-mxfp8-detail mla_decode_kernel --print-details all --section SourceCounters -- \
        $py bench/mla_decode/run.py --batches 64 --contexts 8192 --heads 16 --kinds mxfp8 \
        --eager --rep 2 --no-tune --out /tmp/res/prof-mla ;;
    bitable)  # the committed table alone, then its GPU row test
      section bi-table 120 $py bench/batch_invariant/run.py --out /tmp/res/bi-table
      section bi-rows 150 $py -m pytest -v -p no:cacheprovider -m gpu --timeout 140 \
        -k "rows_bitwise and dtype0" plugins/batch_invariant/tests/test_gpu.py ;;
    bi2) section bi-bench 200 $py bench/batch_invariant/run.py --configs all --budget 150 \
           --shapes 4096x4096,14336x4096,4096x14336 --out /tmp/res/bi-bench ;;
    last)  # the committed matmul table, the split-K GPU test, two-rank tests and the TP = 2 engine
      lane_a() { section bi-table 120 $py bench/batch_invariant/run.py --out /tmp/res/bi-table; }
      lane_b() { section bi-split 200 $py -m pytest -v -p no:cacheprovider -m gpu --timeout 190 \
        --durations 5 -k "split_k_sums and dtype0" plugins/batch_invariant/tests/test_gpu.py; }
      lanes lane_a lane_b
      [ "$ngpu" -ge 2 ] && section tp2-tests 120 $py -m pytest -v -p no:cacheprovider -m gpu \
        --timeout 110 plugins/tp_collectives/tests
      [ "$ngpu" -ge 2 ] && section coll-tp2 120 torchrun --nproc-per-node 2 \
        bench/collectives/engine_tp2.py --out /tmp/res/coll-tp2 ;;
    smallm)  # the FP4 GEMMs' small-M defaults profiled, next to their candidate sweeps
      lane_prof() {
        prof nvfp4-m16-p3 nvfp4_matmul_hw --print-details all -- $py bench/nvfp4/run.py \
          --shapes 8192x8192 --ms 16 --timer events --rep-ms 2 --out /tmp/res/prof-nv
        prof mxfp4-m16-p3 _mxfp4_gemm_kernel --print-details all -- $py bench/mxfp4/run.py \
          --shapes 8192x8192 --ms 16 --rep 2 --out /tmp/res/prof-mx
        section mxfp4-bench 110 $py bench/mxfp4/run.py --configs all --ms 1,16 --sweep-ms 16 \
          --budget 80 --out /tmp/res/mxfp4-bench
      }
      lane_sweep() { section nvfp4-bench 110 $py bench/nvfp4/run.py --configs all --rep-ms 10 \
        --ms 1,16 --out /tmp/res/nvfp4-bench; }
      lanes lane_sweep lane_prof ;;
    diagnose)  # Nsight Compute profiles next to the matmul sweep and the GPU tests
      lane_sweep_tests() { bi_sweep; gpu_tests; }
      lanes lane_sweep_tests profile ;;
    final)
      if [ "$ngpu" -ge 2 ]; then
        CUDA_VISIBLE_DEVICES=0 kernels_a & CUDA_VISIBLE_DEVICES=1 kernels_b & wait
        two_gpus
      else
        kernels_a; kernels_b
      fi ;;
    retune)  # the kernel round after the first results: two lanes, no two-GPU runs
      lane_a() {
        section nvfp4-bench 120 $py bench/nvfp4/run.py --configs all --rep-ms 15 --ms 1,16,64,256 \
          --out /tmp/res/nvfp4-bench
        section mla-bench 90 $py bench/mla_decode/run.py --budget-s 60 --out /tmp/res/mla-bench
      }
      lane_b() {
        section mxfp4-bench 120 $py bench/mxfp4/run.py --configs all --budget 90 \
          --out /tmp/res/mxfp4-bench
        section bi-bench 100 $py bench/batch_invariant/run.py --configs all --budget 80 \
          --out /tmp/res/bi-bench
      }
      if [ "$ngpu" -ge 2 ]; then
        CUDA_VISIBLE_DEVICES=0 lane_a & CUDA_VISIBLE_DEVICES=1 lane_b & wait
      else
        lane_a; lane_b
      fi ;;
    streamk)  # the NVFP4 wgmma GEMM's GPU tests (stream-K builds included), then its builds
      # at M = 64, 128, 256 (stream K against the split and unsplit defaults) and the table
      section wgmma-tests 150 $py -m pytest -q -p no:cacheprovider -x \
        plugins/quant_nvfp4/tests/test_nvfp4_cuda_wgmma.py
      section wgmma-sweep 150 $py bench/nvfp4/run.py --configs cw-g4n64s4b1,cw-g2n128s4b1,cw-g2n256s3b1,cw-default \
        --ms 64,128,256 --rep-ms 15 --rounds 1 --out /tmp/res/wgmma-sweep
      section nvfp4-table 120 $py bench/nvfp4/run.py --rep-ms 15 --ms 1,4,8,16,64,256 \
        --out /tmp/res/nvfp4-table ;;
    invariant)  # the batch-invariant matmul sweep, then the engine's bit-exact check
      section bi-bench 100 $py bench/batch_invariant/run.py --configs all --budget 70 \
        --out /tmp/res/bi-bench
      section bi-engine 55 $py -m pytest -q -p no:cacheprovider plugins/batch_invariant/tests/test_gpu.py \
        -k speculative ;;
    spec)
      mkdir -p /tmp/stdlib && tar -xzf .corpus/stdlib-3.11.7.tar.gz -C /tmp/stdlib
      section spec-train 270 $py tools/train_drafter.py --out /tmp/res/drafter --device cuda \
        --corpus /tmp/stdlib --time-budget "${SPEC_TRAIN_S:-170}" ;;
    *) echo "unknown section $s" >> "$OUT/summary.txt" ;;
  esac
done
tar -cf "$OUT/results.tar" -C /tmp/res .
for f in /tmp/res/logs/*.log; do echo "---- $f"; tail -n "${TAIL:-25}" "$f" | cut -c1-300; done
cat "$OUT/summary.txt"
