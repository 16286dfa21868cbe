#!/usr/bin/env bash
# Drives a standalone wsync consumer with curl the way SGLang's docs call SGLang's weight-update
# routes (flat JSON bodies, {"success", "message"} replies): init the group, pause, update,
# continue, read the weight version; then every bad body. Then, on `--http-api both`, vLLM's
# weight version and weight checker: the per-tensor SHA-256 the rank reports must equal
# sha256sum of the tensors' bytes in the checkpoint file the trainer published.
wsync="$1"
name=http_sglang_contract
source "$(dirname "$0")/processes.sh"

post() {  # PATH JSON -> "<body> <status>"
  curl -s -X POST "$base$1" -H 'Content-Type: application/json' -d "$2" -w ' %{http_code}'
}
post_bare() { curl -s -X POST "$base$1" -w ' %{http_code}'; }
get() { curl -s "$base$1" -w ' %{http_code}'; }
expect() {  # what, "<reply>", status, text the body must contain
  local code="${2##* }"
  [ "$code" = "$3" ] || fail "$1: HTTP $code, expected $3: $2"
  grep -q -- "$4" <<<"$2" || fail "$1: body lacks '$4': $2"
}
start_consumer() {  # api portfile log
  WSYNC_SERVER_DEV_MODE=1 "$wsync" consumer --standalone --http-api "$1" --http-port 0 \
    --http-port-file "$work/$2" >"$work/$3" 2>&1 &
  pids+=("$!")
  wait_for_file "$work/$2" || fail "consumer ($1) did not start"
  base="http://127.0.0.1:$(cat "$work/$2")"
}

# A checkpoint of two tensors; its bytes are what the weight checker must prove.
header='{"__metadata__":{"format":"pt"},"model.embed.weight":{"dtype":"BF16","shape":[64,32],"data_offsets":[0,4096]},"model.norm.bias":{"dtype":"F32","shape":[100],"data_offsets":[4096,4496]}}'
len=${#header}
write_safetensors "$work/model.safetensors" "$header" 4496
sha_embed=$(tail -c +$((9 + len)) "$work/model.safetensors" | head -c 4096 | sha256sum | cut -d' ' -f1)
sha_norm=$(tail -c +$((9 + len + 4096)) "$work/model.safetensors" | head -c 400 | sha256sum | cut -d' ' -f1)

"$wsync" publisher --standalone --rank 0 --safetensors "$work/model.safetensors" --model ckpt \
  --versions 4 --manifest-out "$work/manifests.jsonl" >"$work/publisher.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ "$( { wc -l <"$work/manifests.jsonl"; } 2>/dev/null)" = 4 ] && break; sleep 0.05; done
[ "$(wc -l <"$work/manifests.jsonl")" = 4 ] || fail "publisher did not write 4 manifests"
m() { sed -n "${1}p" "$work/manifests.jsonl"; }
# update_weights_from_distributed as SGLang's trainers send it, plus wsync's manifest.
update() {  # manifest [weight_version]
  printf '{"names":["model.embed.weight","model.norm.bias"],"dtypes":["bfloat16","float32"],"shapes":[[64,32],[100]],"group_name":"weight_update_group","flush_cache":true,"abort_all_requests":false,"weight_version":%s,"load_format":null,"manifest":%s}' "${2:-null}" "$1"
}

start_consumer sglang port1 consumer1.log
expect version0 "$(get /get_weight_version)" 200 '"weight_version":"0"'
expect init_nccl "$(post /init_weights_update_group '{"master_address":"127.0.0.1","master_port":29500,"rank_offset":1,"world_size":2,"group_name":"weight_update_group","backend":"nccl"}')" 400 'master_address: blocked:.*"success":false'
expect init_default_backend "$(post /init_weights_update_group '{"group_name":"weight_update_group"}')" 400 'backend: blocked:'
expect update_before_init "$(post /update_weights_from_distributed "$(update "$(m 1)")")" 400 'call /init_weights_update_group first'
expect init "$(post /init_weights_update_group '{"group_name":"weight_update_group","backend":"shared-memory"}')" 200 '"success":true'
expect pause "$(post /pause_generation '{"mode":"in_place"}')" 200 '"status":"ok"'
expect update "$(post /update_weights_from_distributed "$(update "$(m 1)" '"step_1"')")" 200 '"success":true'
expect continue "$(post /continue_generation '{}')" 200 '"status":"ok"'
expect version1 "$(get /get_weight_version)" 200 '"weight_version":"step_1"'
expect model_info "$(get /model_info)" 200 '"model_path":"ckpt"'
expect generate "$(post /generate '{"steps":2,"step_ms":0}')" 200 '"weight_versions":\[1\]'
echo "http_sglang_contract: init -> pause -> update -> continue: weight_version step_1 active"

# Every bad body: 400, {"success": false, "message": "<field>: <why>"}, nothing changes.
expect bad_json "$(post /update_weights_from_distributed '{"names":')" 400 'body: invalid JSON format'
expect not_object "$(post /update_weights_from_distributed '[1]')" 400 'body: must be a JSON object'
expect empty_body "$(post_bare /update_weights_from_distributed)" 400 'body: a JSON object is required'
expect no_manifest "$(post /update_weights_from_distributed '{"names":["model.embed.weight"]}')" 400 'manifest: missing'
expect wrong_group "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"group_name":"weight_update_group"/"group_name":"g2"/')")" 400 'group_name: no weight update group'
expect dtype_names "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"dtypes":\["bfloat16"/"dtypes":["float16"/')")" 400 'dtypes\[0\]: float16 differs'
expect shapes "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/\[64,32\]/[32,64]/')")" 400 'shapes\[0\]: differs'
expect names "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"model.norm.bias"\]/"nope"]/')")" 400 'names\[1\]: \\"nope\\" is not in the manifest'
expect flush_cache "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"flush_cache":true/"flush_cache":"yes"/')")" 400 'flush_cache: must be a boolean'
expect abort_all "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"abort_all_requests":false/"abort_all_requests":"no"/')")" 400 'abort_all_requests: must be a boolean'
expect load_format "$(post /update_weights_from_distributed "$(update "$(m 2)" | sed 's/"load_format":null/"load_format":"flattened_bucket"/')")" 400 'load_format: '
expect bad_version "$(post /update_weights_from_distributed "$(update "$(m 2)" '[1]')")" 400 'weight_version: must be a string'
expect old_version "$(post /update_weights_from_distributed "$(update "$(m 1)")")" 400 'weight_version must increase monotonically'
bad=$(m 2 | sed 's/"checksum":"[0-9a-f]*"/"checksum":"0000000000000001"/')
expect corrupt "$(post /update_weights_from_distributed "$(update "$bad")")" 400 'version 1 stays active: .*tensor checksum mismatch'
expect pause_bad_mode "$(post /pause_generation '{"mode":"sideways"}')" 400 'mode: \\"sideways\\" is not one of abort, retract, in_place'
expect pause_bad_json "$(post /pause_generation '{"mode":')" 400 'body: invalid JSON format'
expect init_other_group "$(post /init_weights_update_group '{"group_name":"g2","backend":"shared-memory"}')" 400 'group_name: \\"g2\\" differs'
expect init_other_backend "$(post /init_weights_update_group '{"backend":"local-clone"}')" 400 'backend: \\"local-clone\\" differs'
expect destroy_wrong "$(post /destroy_weights_update_group '{"group_name":"g2"}')" 400 'group_name: no weight update group'
expect still_step_1 "$(get /get_weight_version)" 200 '"weight_version":"step_1"'
expect vllm_routes_off "$(post /init_weight_transfer_engine '{"init_info":{}}')" 404 'path: no route'
expect pause_abort "$(post_bare /pause_generation)" 200 'mode abort'
expect continue_bare "$(post /continue_generation '{}')" 200 '"status":"ok"'
expect destroy "$(post /destroy_weights_update_group '{"group_name":"weight_update_group"}')" 200 '"success":true'
expect update_after_destroy "$(post /update_weights_from_distributed "$(update "$(m 2)")")" 400 'call /init_weights_update_group first'
echo "http_sglang_contract: every bad body refused with its field; step_1 kept"

# --http-api both: SGLang's update, then vLLM's weight version and weight checker.
start_consumer both port2 consumer2.log
expect init2 "$(post /init_weights_update_group '{"backend":"shared-memory"}')" 200 '"success":true'
expect update2 "$(post /update_weights_from_distributed "$(update "$(m 3)")")" 200 '"success":true'
expect weight_info "$(get /weight_info)" 200 '"weight_version":"3"'
expect label "$(post /update_weight_version '{"new_version":"rl-step-3"}')" 200 '"weight_version":"rl-step-3"'
expect weight_info_label "$(get /weight_info)" 200 '"weight_version":"rl-step-3"'
expect sglang_label "$(get /get_weight_version)" 200 '"weight_version":"rl-step-3"'
expect checksum "$(post /weight_checker '{"action":"checksum"}')" 200 "\"model.embed.weight\":\"$sha_embed\""
expect checksum_norm "$(post /weight_checker '{"action":"checksum"}')" 200 "\"model.norm.bias\":\"$sha_norm\""
expect compare_match "$(post /weight_checker "{\"action\":\"compare\",\"baseline\":{\"model.embed.weight\":\"$sha_embed\",\"model.norm.bias\":\"$sha_norm\"}}")" 200 '"match":true'
zero=$(printf '0%.0s' $(seq 64))
expect compare_mismatch "$(post /weight_checker "{\"action\":\"compare\",\"baseline\":{\"model.embed.weight\":\"$zero\",\"model.norm.bias\":\"$sha_norm\"}}")" 200 "\"match\":false,\"mismatches\":\[{\"actual\":\"$sha_embed\",\"expected\":\"$zero\",\"name\":\"model.embed.weight\"}\]"
expect reset "$(post /weight_checker '{"action":"reset"}')" 200 '"status":"reset"'
expect compare_no_baseline "$(post /weight_checker '{"action":"compare"}')" 400 'baseline: missing'
expect checker_bad_action "$(post /weight_checker '{"action":"snapshot"}')" 400 'action: \\"snapshot\\" is not one of checksum, reset, compare'
expect checker_bad_hex "$(post /weight_checker '{"action":"compare","baseline":{"a":"xyz"}}')" 400 'baseline.a: must be a SHA-256 digest'
expect version_bad "$(post /update_weight_version '{"new_version":""}')" 400 'new_version: must be a non-empty string'
expect version_missing "$(post /update_weight_version '{}')" 400 'new_version: missing'
expect vllm_init_on_both "$(post /init_weight_transfer_engine '{"init_info":{}}')" 200 'Weight transfer initialized'
expect update3 "$(post /update_weights_from_distributed "$(update "$(m 4)")")" 200 '"success":true'
expect label_follows "$(get /weight_info)" 200 '"weight_version":"4"'
echo "http_sglang_contract: the weight checker's SHA-256 equals sha256sum of the checkpoint's tensors"

for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait 2>/dev/null
pids=()
check_no_segments
echo "http_sglang_contract: pass"
