"""The Clover decode loop and its steps: drafting, choosing what to verify, verification and acceptance, emitting and compacting."""
