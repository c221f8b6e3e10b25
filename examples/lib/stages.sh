# Shared by the tool examples (tool_sft_then_grpo.sh, agent_calculator.sh): `source` it after setting
# OUT (the pipeline's folder), DATA (its prep output), TOOLS (the tool config) and N_EVAL.
stage() {  # stage NAME COMMAND...: run it, append its wall time and the load averages around it
    local start=$SECONDS before
    before=$(uptime)
    "${@:2}"
    echo "$1: $((SECONDS - start)) s | before: $before | after: $(uptime)" >> "$OUT/timings.txt"
}
evaluate() {  # evaluate STAGE MODEL
    stage "eval $1" python benchmarks/tool_use_eval.py --stage "$1" --model "$2" --data "$DATA/test.parquet" \
        --tool-config "$TOOLS" --n "$N_EVAL" --json "$OUT/tool_use.jsonl"
}
