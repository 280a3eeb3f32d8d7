"""Speculative decoding: EAGLE / NextN draft worker, draft tree and verification."""
