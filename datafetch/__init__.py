"""Getting the data sets: `download` (the public ones, fetched and checked) and `imagenet100` (from ImageNet-1k)."""
