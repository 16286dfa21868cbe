#!/usr/bin/env bash
# `wsync publisher --safetensors FILE`: two trainer ranks publish their shares of a checkpoint
# file; a consumer installs both versions.
wsync=$(readlink -f "$1")
name=cluster_safetensors
source "$(dirname "$0")/processes.sh"
header='{"__metadata__":{"format":"pt"},"a.weight":{"dtype":"BF16","shape":[64,32],"data_offsets":[0,4096]},"b.bias":{"dtype":"F32","shape":[100],"data_offsets":[4096,4496]}}'
write_safetensors "$work/model.safetensors" "$header" 4496
export WSYNC_TOKEN=st-token
"$wsync" coordinator --port 0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
addr="127.0.0.1:$(cat "$work/port")"
"$wsync" consumer --coordinator "$addr" --rank 0 --model ckpt >"$work/consumer.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do
  "$wsync" status --coordinator "$addr" --json | grep -q '"role":"consumer"' && break
  sleep 0.05
done
for r in 0 1; do
  "$wsync" publisher --coordinator "$addr" --rank $r --ranks 2 --safetensors "$work/model.safetensors" \
    --model ckpt --versions 2 --json >"$work/publisher$r.log" 2>&1 &
  pub[$r]=$!
  pids+=("$!")
done
for r in 0 1; do wait "${pub[$r]}" || fail "publisher $r failed"; done
[ "$(grep -c '"phase":"committed"' "$work/publisher0.log")" -eq 2 ] || fail "versions not committed"
grep -q "active version 2 (ckpt@2)" "$work/consumer.log" || fail "consumer not on version 2"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
echo "cluster_safetensors: pass"
