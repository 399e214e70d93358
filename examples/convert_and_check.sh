#!/usr/bin/env bash
# Convert a tiny random Qwen2 model to Megatron, compare logits at TP=2 (2 CPU processes, gloo),
# and export it back. Run from the repository root after `make venv`.
set -euo pipefail
PY=${PY:-.venv/bin/python}
work=$(mktemp -d)
$PY -c "from cooper_mcore.models.tiny import save_tiny_hf_model as m, save_tiny_tokenizer as t; t(m('$work/hf', 'qwen2'))"
$PY -m cooper_mcore convert hf-to-mcore --hf-dir "$work/hf" --out "$work/mcore"
$PY -m torch.distributed.run --nproc_per_node 2 tools/compare_logits.py \
    --hf-dir "$work/hf" --ckpt "$work/mcore" --tp 2
$PY -m cooper_mcore convert mcore-to-hf --ckpt "$work/mcore" --out "$work/hf_back"
echo "outputs in $work"
