"""Process groups and launch plumbing: the groups DeepSpeed and the runtime talk over (restart-safe
stores, gloo host groups), collectives with a recognisable failure, host-side agreement among ranks,
DeepSpeed op builds and torch version shims. The lowest layer: it imports nothing else of the runtime."""
