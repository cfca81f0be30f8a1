"""Streaming DiLoCo (Douillard et al. 2025): one fragment's outer step at a time, its all-reduce
overlapped with the inner steps."""
