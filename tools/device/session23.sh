#!/usr/bin/env bash
# Device script for session 23 (issue 15): the decode step of branch next/dq8-lop3 (B) against
# main before it (A, binaries packed as krasis-runtime-a / kbench-a) and a variant of the branch
# whose new programmatic dependents wait before they trigger (C, -c), at three contexts.
# The branch gained 12% at 32-token prompts but nothing at 1,000 (549.9 tok/s against session
# 19's 557.3 on main): is the context-dependent part (decode attention, its launches) slower?
#   bash tools/device/session23.sh ab COMMIT
#       a3b-24l all resident: `bench --decode-rows` at 32, 1,000 and 16,000-token prompts for
#       each binary packed (rows 1 and 4 below 16K, 1 at 16K), then `kbench --attn-decode`;
#       first the kernel tests fp16_mlp:: of the branch; after the benches the variant's rows::
#       and batching tests (gpuc-*, batchingc-*).
# Carry dist/pack (xz-packed stripped binaries), .cache/vocab. Results: $OUT/session23-ab.txt.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session23-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
echo "prep (t=$((SECONDS-T0))s)" >> "$S"
M=(--model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache --prompt-tokens 1000)
case "$P" in
  ab)
    # The FP16 expert entry points (_r32_f16 among them): session 23's first kernel-test runs
    # filtered fp16:: and missed fp16_mlp::.
    test_bin gpu 45 fp16_mlp::
    for ctx in 1000:128:1,4 16000:64:1 32:50:1,4; do
      IFS=: read -r pt dt rows <<< "$ctx"
      for v in "" -a -c; do
        b=dist/gpu/krasis-runtime$v; [ -x "$b" ] || continue
        timeout 100 "$b" bench "${M[@]}" --commit "$C$v" --decode-prompt-tokens "$pt" --decode-tokens "$dt" \
          --decode-rows "$rows" --json "$OUT/bench-$pt$v.json" > "$OUT/bench-$pt$v.log" 2>&1
        echo "bench prompt $pt ($C$v) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
        grep -E "^decode [0-9] rows" "$OUT/bench-$pt$v.log" | cut -c1-330 >> "$S"
      done
    done
    # The variant's own test binaries (gpuc-*, batchingc-*): row invariance and batching.
    test_bin gpuc 90 rows::
    test_bin batchingc 45
    for v in "" -c; do
      [ -x dist/gpu/kbench$v ] || continue
      timeout 60 dist/gpu/kbench$v --attn-decode > "$OUT/kbench$v-attn-decode.txt" 2>&1
      echo "kbench$v --attn-decode rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "attn decode" "$OUT/kbench$v-attn-decode.txt" | cut -c1-160 >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
