#!/usr/bin/env bash
# Destroy a session's stores (a persistent store holds 50-130 GiB of host memory that the next systems
# need), through the installed package rather than its console script: on the device the project's
# install skips its scripts where /tmp/site/bin already exists (the wheels installed first can make
# it), so `slidedp-store` can be missing. A store that exists and stays is said on stderr, and the
# exit status is 1: a kept Qwen3-8B store got the next part's four peers killed for host memory
# (2026-12-02), while its failed destroy went unseen.
#   bash benchmarks/sessions/drop_store.sh STORE...
rc=0
for store in "$@"; do
  [ -e "/dev/shm/slidedp.$store.manifest" ] || continue  # no such store: nothing to do
  # from /: run in the checkout, `python3 -m` would find its slidedp/ first, which has no launch/
  if ! out=$(cd / && python3 -m slidedp.launch.store_cli destroy --force "$store" 2>&1) \
     || [ -e "/dev/shm/slidedp.$store.manifest" ]; then
    echo "drop_store: store $store is still there: $out" >&2
    rc=1
  fi
done
exit $rc
