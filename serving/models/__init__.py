"""Model lifecycle: registry, versions, reload, store, endpoint, residency under a memory budget."""
