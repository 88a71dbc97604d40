"""Process and thread plumbing that knows no gpupipe concept (no batch, recipe or backend): one host-to-device copy
per batch (:mod:`.host_pack`), buffers dropped off the caller's thread (:mod:`.reaper`), a DataLoader's workers begun
and iterated (:mod:`.workers`), work made ahead on a thread of its own (:mod:`.decode_ahead`). Everything else in
gpupipe may import it; it imports nothing of gpupipe but ``_system``."""
