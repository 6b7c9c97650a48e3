#!/usr/bin/env bash
# What a lent GPU session runs, in phases that each fit one device call (10 min), so the measurements
# that need a GPU take a few calls, not a session of set-up. Each phase writes its output under
# $OUT (the device tool brings it back) and prints a summary; copy the JSON into benchmarks/results/.
#
# Here, first:   python3 ../shared/tools/gpu_wheels.py          (py3.12 wheels into .whl/)
# Then, per call (carry .whl):   bash benchmarks/gpu_session.sh <phase>
#   current the code as it stands, first (~9 min): the GPU tests of the batch's pinned copies (the host queues
#           them behind a busy stream), of the offloaded EMA's side stream, of the planned attention operator and of
#           bf16 gradient buffers (the flat step's Triton kernel reading them) and of the offloaded sharded EMA,
#           the host's time per layer with packed
#           attention inside the compiled layer vs outside it (benchmarks/host_overhead.py), then MovieGen-3B at 8k tokens, batch 1,
#           4 micro-batches per optimizer step, no recompute, bf16 moments, the EMA offloaded every 10 steps (last H100
#           lease: 38.2% MFU; the host queued a micro-batch's forward and backward in ~243 ms, about the device's time:
#           host-bound), its packed attention on torch's flash varlen kernel (auto) and on cuDNN's dense kernel per run
#           of equal segments (sdpa_cudnn, GQA's kv heads repeated; same process: flash's backward took 34 of the 3B's
#           ~51 ms of attention per micro-batch on the H100, and cuDNN halved DiT-XL/2's attention on the H200; a new
#           run shape builds a cuDNN graph, which the timed steps carry), profiled on the device and on the host
#           (cProfile: the functions to cut), with the host's time per phase of the step
#   generate  class-conditional sampling against diffusers' DiTPipeline (benchmarks/generate_vs_diffusers.py): DiT-XL/2,
#           random weights, 50 DDIM steps, guidance 4, batch 8, bf16, 256 and 512 px, eager and compiled (~7 min; goal
#           issue #35: >= 1.3x compiled); at 512 px also FORA step caching's wall-time speed-up (issue #37's GPU row)
#   rates   the planner's attention calibration (~2 min): benchmarks/attention_rates.py, forward + backward by keys
#           (256..16k) and head dim (64, 72, 128), dense (cuDNN) and packed (varlen), replacing plan/gpus.py's
#           published FlashAttention-3 figures (issue #38)
#   tests   GPU tests: kernels vs float64, training on CUDA, a distributed-optimizer resume on torch's
#           AdamW, FP8 (torchao, real float8 GEMMs), compiled == eager
#   fp8     FP8 recipes against bf16, profiled (~9 min): DiT-XL/2 256px batch 128 and the 3B packed point (batch 2),
#           compiled, bf16 vs tensorwise vs rowwise_with_gw_hp (goal: >= 1.65x; fusion_traffic.py counts the casts at
#           +85 to +141 kB/token/layer over bf16's 152 on DiT-XL/2, +171 to +337 over 290 on the 3B layer)
#   grid    DiT-XL/2 throughput grid with --autotune and diffusers side by side (goals: 2x, 50% MFU)
#   packed  MovieGen-3B on 8k-token packed video latents at batch 2 with the MLP recomputed, bf16 moments and the
#           EMA offloaded (~6 min; goal: 55% MFU; batch 1 without recompute gave 30.1% on the H100)
#   stall   checkpoint stall per save, synchronous vs asynchronous, at DiT-XL/2 size
#   short   what one 15-minute lease measures in one call (~9 min, each part capped by `timeout`, results
#           copied under $OUT as each part ends): FP8/compile/resume GPU tests, the 3B packed point (batch 2,
#           bf16 vs FP8 tensorwise), DiT-XL/2 bf16 vs FP8 tensorwise/rowwise (SKIP_XL=1 leaves it out);
#           plots come back as one tarball
#   profile where the device time goes (~8 min): DiT-XL/2 b128 compiled with fused vs foreach AdamW, the
#           3B packed point (batch 2), each with the time per kind of kernel and the top kernels; then
#           diffusers side by side at batch 128, compiled, both profiled
#   kernels the attention kernel choice (~6 min): GPU attention and compile tests; DiT-XL/2 b128 compiled with
#           auto attention (cuDNN on Hopper) vs torch's flash kernel, profiled; diffusers side by side at batch 128
#   grads   bf16 gradient buffers (~7 min): the optimizer step alone at MovieGen-3B's widths, the flat step on fp32
#           vs bf16 buffers (benchmarks/optimizer_step.py: 33 vs 31 bytes per parameter); MovieGen-3B at 8k tokens
#           (batch 1, 4 micro-batches), fp32 vs bf16 gradient buffers (optim.main_grads_dtype, same process: half the
#           bytes zeroed, accumulated and read by the optimizer; 6.2 GiB less), profiled
#   split   split main weights (optim.split_main_params, ~7 min): MovieGen-3B at 8k tokens with the leanest state
#           (11 bytes per parameter: bf16 buffers, moments and the weights' int16 remainders; the EMA offloaded) at
#           batch 2 against batch 1 (2 micro-batches per step): does a second sample per micro-batch fit on 80 GB,
#           and what the host gains from it (the grads phase times the split step alone: 33 vs 29 B/param)
#   step    the trainer's step as it stands (~7 min): the fused-AdamW resume test on CUDA; DiT-XL/2 compiled at
#           batch 128 and 256 (separate processes), the 3B packed point at batch 2, each profiled (host syncs and
#           device busy per step: what the step's one host read, the gradient norm, costs at compiled points; the
#           device-decided step was removed after 1.01x eager, issue 39)
#   gaps    packed attention without gather/scatter copies (~5 min): the GPU kernel tests on packed layouts
#           (padding between segments included); the 3B packed point at batch 2 and DiT-XL/2 at batch 256,
#           compiled, profiled
#   linears the aten linears (~8 min): compile tests; DiT-XL/2 b128 compiled with aten vs megatron's
#           linears (`--aten-linears 1,0 --wgrad-fusion 0`, same process: the matmuls alone), profiled; the
#           model against diffusers at batch 128, compiled, profiled
#           (Triton time side by side; benchmarks/fusion_traffic.py predicts 0.87x the bytes)
#   accumulate  per-parameter work shared by micro-batches (~7 min): the 3B packed point at batch 2 with 1
#           and 4 micro-batches per optimizer step (`--accumulation 1,4`), DiT-XL/2 b128 with 4, compiled
#   wgrad   weight gradients accumulated into main_grad inside the GEMM (~8 min): the GPU kernel test, then the
#           3B packed point (batch 2, 2 micro-batches per step) and DiT-XL/2 b128, compiled, with the fused
#           accumulation vs megatron DDP's hook (`--wgrad-fusion 1,0`, same process), profiled
#   tuning  Inductor options for the fused kernels (~9 min): DiT-XL/2 b128 compiled with torch's defaults,
#           with multi-kernel reductions (persistent ones generated too, the faster picked on the device: the
#           forward LayerNorm kernels over 1152 channels are looped reductions by default and ran at ~0.8-0.9
#           TB/s on the H200) and with on-device block-size tuning, profiled (Triton time per step side by side)
#   optimizer  optim.adam_impl=flat (~8 min): its tests on CUDA, benchmarks/optimizer_step.py at MovieGen-3B's
#           widths, then the 3B packed point (batch 2) and DiT-XL/2 b128, compiled, with the flat vs the fused
#           AdamW (`--adam flat,fused`, same process), profiled (optimizer and copy time per step)
#   autotune  model.compile_mode (~9 min): DiT-XL/2 b128 compiled with the default mode and with
#           max-autotune-no-cudagraphs (Triton GEMM templates with fused epilogues against cuBLAS), profiled
set -euo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bash benchmarks/gpu_session.sh current|generate|rates|tests|fp8|grid|packed|stall|short|profile|kernels|grads|split|step|gaps|linears|accumulate|wgrad|tuning|optimizer|autotune}
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  # kernels/ and recipes/ are the packages dit_mcore.kernels and dit_mcore.recipes (setup.py's package_dir), which
  # a PYTHONPATH alone does not map (links ignored by git)
  ln -sfn ../kernels dit_mcore/kernels && ln -sfn ../recipes dit_mcore/recipes
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
# The 3B packed point: batch 2 where it fits (the H200's 139 GB: 110 GiB peak); on an 80 GB card batch 1 with the
# EMA in host memory (22 B/param of state, 67.8 GiB, left less than one 8k-token sample's ~21 GiB of activations)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if [ "${mib:-0}" -ge 100000 ]; then B3="--batches 2"; else B3="--batches 1 --ema-offload 1 --ema-every 10"; fi
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$out/device.txt"
case "$phase" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_training.py tests/test_fp8.py \
      tests/test_compile.py 2>&1 | tee "$out/tests.txt" | tail -n 30 ;;
  fp8)
    timeout 270 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --fp8 none,tensorwise,rowwise_with_gw_hp --profile \
      --warmup 3 --steps 5 --out "$out/throughput_3b_fp8.jsonl" 2>&1 | grep -v -i warn | tail -n 30 || true
    timeout 250 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --fp8 none,tensorwise,rowwise_with_gw_hp --profile --warmup 4 --steps 8 \
      --out "$out/throughput_xl_fp8.jsonl" 2>&1 | grep -v -i warn | tail -n 30 || true ;;
  grid)
    python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 64,128 --compile 0,1 \
      --recompute none,selective --dtype bf16 --diffusers --autotune --warmup 5 --steps 15 \
      --out "$out/throughput_grid.jsonl" ;;
  packed)  # batch 2 with the MLP recomputed (traced into the compiled layers), the state that fits 80 GB
    timeout 560 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 --batches 2 --compile 1 --recompute selective --dtype bf16 --moments bf16 --ema-offload 1 \
      --ema-every 10 --profile --warmup 3 --steps 10 --out "$out/throughput_packed.jsonl" 2>&1 | grep -v -i warn \
      | tail -n 40 || true ;;
  generate)
    for size in 256 512; do
      for compiled in "" "--compile"; do
        cache=""; [ "$size" = 512 ] && cache="--cache fora:2,fora:3"
        timeout 200 python3 benchmarks/generate_vs_diffusers.py --size $size $compiled $cache \
          --out "$out/generate_vs_diffusers_${size}${compiled:+_compiled}.json" 2>&1 | grep -v -i warn | tail -n 7 || true
      done
    done ;;
  rates)
    timeout 400 python3 benchmarks/attention_rates.py --out "$out/attention_rates.jsonl" 2>&1 | grep -v -i warn \
      | tail -n 60 || true ;;
  stall)
    python3 benchmarks/checkpoint_stall.py --hidden 1152 --layers 28 2>&1 | tee "$out/checkpoint_stall.txt" ;;
  short)
    work=/tmp/gpu_short; mkdir -p "$work"
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_compile.py \
      tests/test_gpu_training.py::test_a_distributed_optimizer_checkpoint_resumes_on_the_gpu \
      2>&1 | tee "$out/tests.txt" | tail -n 15 || true
    timeout 220 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --fp8 none,tensorwise --warmup 6 --steps 8 \
      --out "$work/throughput_packed.jsonl" 2>&1 | grep -v -i warn | tail -n 25 || true
    cp "$work"/throughput_packed.jsonl "$out"/ 2>/dev/null || true
    if [ -z "${SKIP_XL:-}" ]; then
      timeout 230 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
        --dtype bf16 --fp8 none,tensorwise,rowwise --warmup 6 --steps 15 --out "$work/throughput_fp8.jsonl" 2>&1 \
        | grep -v -i warn | tail -n 25 || true
      cp "$work"/throughput_fp8.jsonl "$out"/ 2>/dev/null || true
    fi
    tar czf "$out/plots.tgz" -C "$work" . ;;
  profile)
    timeout 170 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --adam fused,foreach --profile --warmup 6 --steps 12 --out "$out/throughput_xl_profile.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/xl_profile.txt" | tail -n 70 || true
    timeout 150 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --profile --warmup 5 --steps 6 \
      --out "$out/throughput_3b_profile.jsonl" 2>&1 | grep -v -i warn | tee "$out/3b_profile.txt" | tail -n 40 || true
    timeout 170 python3 benchmarks/train_step.py --preset DiT-XL/2 --batch 128 --dtype bf16 --compile --rounds 3 \
      --steps 4 --profile --out "$out/train_step_xl_b128_compiled_profile.json" 2>&1 | grep -v -i warn \
      | tee "$out/train_step_profile.txt" | tail -n 60 || true ;;
  kernels)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_compile.py 2>&1 \
      | tee "$out/tests.txt" | tail -n 15 || true
    timeout 170 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --attention auto,sdpa_flash --profile --warmup 6 --steps 12 \
      --out "$out/throughput_xl_attention.jsonl" 2>&1 | grep -v -i warn | tee "$out/xl_attention.txt" | tail -n 60 || true
    timeout 110 python3 benchmarks/train_step.py --preset DiT-XL/2 --batch 128 --dtype bf16 --compile --rounds 3 \
      --steps 4 --out "$out/train_step_xl_b128_compiled.json" 2>&1 | grep -v -i warn | tail -n 5 || true ;;
  grads)
    timeout 60 python3 benchmarks/optimizer_step.py --out "$out/optimizer_step.json" 2>&1 | grep -v -i warn \
      | tail -n 14 || true
    timeout 330 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 --batches 1 --accumulation 4 --grads fp32,bf16 --compile 1 --dtype bf16 --moments bf16 \
      --ema-offload 1 --ema-every 10 --profile --warmup 3 --steps 10 --out "$out/throughput_3b_grads.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/3b_grads.txt" | tail -n 60 || true ;;
  split)  # the leanest state (bf16 gradient buffers and moments, split main weights, the EMA offloaded: 11 B/param,
    # 34 GiB of the 3B) leaves room for two 8k-token samples per micro-batch: batch 2 against batch 1, 2 micro-batches
    timeout 420 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 --batches 2,1 --accumulation 2 --grads bf16 --split-mains 1 --compile 1 --dtype bf16 \
      --moments bf16 --ema-offload 1 --ema-every 10 --profile --warmup 3 --steps 10 \
      --out "$out/throughput_3b_split_b2.jsonl" 2>&1 | grep -v -i warn | tee "$out/3b_split.txt" | tail -n 60 || true ;;
  step)  # JSON lines and printouts come back under $OUT, the plots as one tarball (the tool brings back few files)
    work=/tmp/gpu_step; mkdir -p "$work"
    timeout 60 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gpu_training.py::test_a_distributed_optimizer_checkpoint_resumes_on_the_gpu 2>&1 \
      | tee "$out/tests.txt" | tail -n 5 || true
    for b in 128 256; do
      timeout 200 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches $b --compile 1 \
        --dtype bf16 --profile --warmup 4 --steps 8 --out "$work/throughput_xl_b$b.jsonl" 2>&1 \
        | grep -v -i warn | tee "$out/xl_b$b.txt" | tail -n 30 || true
      cp "$work/throughput_xl_b$b.jsonl" "$out/" 2>/dev/null || true
    done
    timeout 120 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --profile --warmup 5 --steps 6 \
      --out "$work/throughput_3b.jsonl" 2>&1 | grep -v -i warn | tee "$out/3b.txt" | tail -n 30 || true
    cp "$work/throughput_3b.jsonl" "$out/" 2>/dev/null || true
    tar czf "$out/plots.tgz" -C "$work" --exclude='*.jsonl' . ;;
  gaps)  # plots stay on the machine: at most 8 files come back
    work=/tmp/gpu_gaps; mkdir -p "$work"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "packed" 2>&1 \
      | tee "$out/tests.txt" | tail -n 15 || true
    timeout 150 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --profile --warmup 5 --steps 6 \
      --out "$work/throughput_3b_gaps.jsonl" 2>&1 | grep -v -i warn | tee "$out/3b.txt" | tail -n 30 || true
    timeout 130 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 256 --compile 1 \
      --dtype bf16 --profile --warmup 4 --steps 8 --out "$work/throughput_xl_b256.jsonl" 2>&1 | grep -v -i warn \
      | tee "$out/xl_b256.txt" | tail -n 25 || true
    cp "$work"/*.jsonl "$out/" 2>/dev/null || true ;;
  linears)  # at most 8 files come back: the JSON lines and printouts, no plots
    work=/tmp/gpu_linears; mkdir -p "$work"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py 2>&1 | tee "$out/tests.txt" | tail -n 5 || true
    timeout 230 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --aten-linears 1,0 --wgrad-fusion 0 --profile --warmup 4 --steps 8 --out "$work/throughput_xl_linears.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/xl_linears.txt" | tail -n 40 || true
    timeout 130 python3 benchmarks/train_step.py --preset DiT-XL/2 --batch 128 --dtype bf16 --compile --rounds 3 \
      --steps 4 --profile --out "$work/train_step_xl_b128_compiled.json" 2>&1 | grep -v -i warn \
      | tee "$out/train_step.txt" | tail -n 40 || true
    cp "$work"/*.jsonl "$work"/*.json "$out/" 2>/dev/null || true ;;
  accumulate)
    work=/tmp/gpu_accumulate; mkdir -p "$work"
    timeout 330 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --accumulation 1,4 --compile 1 --dtype bf16 --warmup 3 --steps 4 \
      --out "$work/throughput_3b_accumulation.jsonl" 2>&1 | grep -v -i warn | tee "$out/3b.txt" | tail -n 20 || true
    timeout 200 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --accumulation 4 \
      --compile 1 --dtype bf16 --warmup 2 --steps 4 --out "$work/throughput_xl_accumulation.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/xl.txt" | tail -n 20 || true
    cp "$work"/*.jsonl "$out/" 2>/dev/null || true ;;
  current)  # each part writes straight under $out (a killed call keeps what finished)
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_training.py tests/test_ema.py \
      tests/kernels/test_planned_attention.py tests/test_stdit.py tests/test_flat_adam.py tests/test_split_main.py \
      -k "without_blocking or staged or in_bf16 or gradient_buffers or sharded_ema or kernel_steps_split \
          or split_and_join" 2>&1 | tee "$out/tests.txt" | tail -n 8 || true
    # packed attention as one operator in the compiled layer vs outside the graph: the host's time per layer
    timeout 130 python3 benchmarks/host_overhead.py --warmup 3 --repeats 1 --out "$out/host_overhead.json" 2>&1 | tail -n 4 || true
    # the 3B at batch 1 was host-bound (the host queued a micro-batch in about the device's time): is it still, with
    # attention in the graph? Then cuDNN's attention against flash's; 10 timed steps hold exactly one EMA fold of 10
    timeout "${T3B:-360}" python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 --batches 1 --accumulation 4 --attention "${ATTENTION:-auto,sdpa_cudnn}" --compile 1 --dtype bf16 \
      --moments bf16 --ema-offload 1 \
      --ema-every 10 --profile --host-profile --warmup 3 --steps 10 --out "$out/throughput_3b_b1_host.jsonl" 2>&1 \
      | grep -v -i warn | tail -n 80 || true ;;
  optimizer)
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_flat_adam.py tests/test_ema.py 2>&1 \
      | tee "$out/tests_flat_adam.txt" | tail -n 5 || true
    timeout 60 python3 benchmarks/optimizer_step.py --out "$out/optimizer_step.json" 2>&1 | grep -v -i warn \
      | tail -n 5 || true
    timeout 230 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --compile 1 --dtype bf16 --adam flat,fused --profile --warmup 3 --steps 5 \
      --out "$out/throughput_3b_adam.jsonl" 2>&1 | grep -v -i warn | tail -n 30 || true
    timeout 150 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --adam flat,fused --profile --warmup 4 --steps 8 --out "$out/throughput_xl_adam.jsonl" 2>&1 \
      | grep -v -i warn | tail -n 30 || true ;;
  wgrad)
    work=/tmp/gpu_wgrad; mkdir -p "$work"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_training.py -k "wgrad" 2>&1 \
      | tee "$out/tests.txt" | tail -n 5 || true
    timeout 330 python3 benchmarks/throughput.py --family llama --presets MovieGen-3B --image-sizes "" \
      --packed-lens 8192 $B3 --accumulation 2 --aten-linears 1 --wgrad-fusion 1,0 --compile 1 --dtype bf16 --profile \
      --warmup 3 --steps 4 --out "$work/throughput_3b_wgrad_fusion.jsonl" 2>&1 | grep -v -i warn \
      | tee "$out/3b.txt" | tail -n 40 || true
    timeout 150 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --aten-linears 1 --wgrad-fusion 1,0 --warmup 3 --steps 6 --out "$work/throughput_xl_wgrad_fusion.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/xl.txt" | tail -n 20 || true
    cp "$work"/*.jsonl "$out/" 2>/dev/null || true ;;
  tuning)
    timeout 560 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --compile-options "none;triton.multi_kernel=1;coordinate_descent_tuning=True" --profile \
      --warmup 4 --steps 8 --out "$out/throughput_xl_tuning.jsonl" 2>&1 \
      | grep -v -i warn | tee "$out/xl_tuning.txt" | tail -n 40 || true ;;
  autotune)
    timeout 560 python3 benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
      --dtype bf16 --compile-mode default,max-autotune-no-cudagraphs --profile --warmup 4 --steps 8 \
      --out "$out/throughput_xl_compile_mode.jsonl" 2>&1 | grep -v -i warn | tee "$out/xl_compile_mode.txt" \
      | tail -n 40 || true ;;
  *)
    echo "unknown phase $phase" >&2; exit 2 ;;
esac
