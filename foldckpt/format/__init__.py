"""The output contract convert writes and verify and the serving loader read: manifest, sidecars, the consistency check."""
