#!/usr/bin/env bash
# Regenerate what every examples/*/ folder shows next to its spec.yaml:
#   plan.txt        the `placer plan` table
#   placement.dot   the placement graph's source (what tests/unit/test_examples.py compares)
#   placement.svg   the placement graph, rendered by graphviz
#   schedule.svg    the pipeline schedule chart (pipeline specs only)
# Run it after changing a spec, the planner or the renderers, and commit the diff with that change.
# Needs graphviz `dot` (apt-get install graphviz).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v dot >/dev/null; then
  echo "render_examples.sh: graphviz \`dot\` is needed to render placement.svg (apt-get install graphviz)" >&2
  exit 1
fi

for spec in "$root"/examples/*/spec.yaml; do
  dir="$(dirname "$spec")"
  rm -f "$dir"/plan.txt "$dir"/placement.dot "$dir"/placement.svg "$dir"/schedule.svg
  # --deep: the examples' model files are ours, so planning may run them; --schedule writes
  # nothing for a spec without a pipeline. Run from the folder so that outputs hold no paths.
  (cd "$dir" && placer plan --quiet --deep --dot placement.dot --svg placement.svg \
     --schedule schedule.svg spec.yaml > plan.txt)
  echo "rendered examples/$(basename "$dir"): $(cd "$dir" && ls plan.txt placement.* schedule.svg 2>/dev/null | tr '\n' ' ')"
done
