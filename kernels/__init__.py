"""KV block movement between paged KV and staging buffers (torch; CPU in tests, GPU fast paths)."""
