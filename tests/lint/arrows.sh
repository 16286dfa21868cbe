#!/usr/bin/env bash
# Fails on an include that runs against the module arrows (docs/architecture.md):
#   manifest <- transports <- {sources, runtime} <- actors <- cluster <- {http, bench} <- apps
#   actors <- python (the Python module, beside cluster)
# A module may include its own headers and those of the modules below it, never one above it or
# beside it. Run from the repository root; prints every back edge it finds.
set -uo pipefail

# module -> the modules whose public headers (wsync/<module>/...) it may include
declare -A allowed=(
  [manifest]="manifest"
  [transports]="manifest transports"
  [sources]="manifest transports sources"
  [runtime]="manifest transports runtime"
  [actors]="manifest transports sources runtime actors"
  [cluster]="manifest transports sources runtime actors cluster"
  [http]="manifest transports sources runtime actors cluster http"
  [bench]="manifest transports sources runtime actors cluster bench"
  [apps]="manifest transports sources runtime actors cluster http bench"
  [python]="manifest transports sources runtime actors"
)

bad=0
checked=0
for module in "${!allowed[@]}"; do
  [ -d "$module" ] || { echo "arrows: module folder $module/ is missing"; bad=1; continue; }
  while IFS= read -r hit; do
    [ -n "$hit" ] || continue
    file=${hit%%:*}
    target=$(sed -E 's@.*#include[[:space:]]*[<"]wsync/([a-z_]+)/.*@\1@' <<<"${hit#*:*:}")
    checked=$((checked + 1))
    case " ${allowed[$module]} " in
      *" $target "*) ;;
      *) echo "arrows: $file includes wsync/$target/ but $module may only use: ${allowed[$module]}"
         bad=1 ;;
    esac
  done < <(grep -rnE '#include[[:space:]]*[<"]wsync/[a-z_]+/' "$module" --include='*.cpp' --include='*.hpp' 2>/dev/null)
  # CMake dependencies must follow the same arrows.
  while IFS= read -r dep; do
    [ -n "$dep" ] || continue
    checked=$((checked + 1))
    case " ${allowed[$module]} " in
      *" $dep "*) ;;
      *) echo "arrows: $module/CMakeLists.txt links wsync::$dep but $module may only use: ${allowed[$module]}"
         bad=1 ;;
    esac
  done < <(grep -ohE 'wsync::[a-z_]+' "$module/CMakeLists.txt" 2>/dev/null | sed 's/wsync:://' | sort -u)
done
[ "$checked" -gt 0 ] || { echo "arrows: found no include to check (run from the repository root)"; exit 1; }
[ $bad -eq 0 ] && echo "arrows: $checked includes and links follow the arrows"
exit $bad
