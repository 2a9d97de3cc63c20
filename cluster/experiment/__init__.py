"""`pdcluster experiment`: a baseline and variants that each change one thing, run
interleaved over repeats against a live deployment, compared with stated noise rules,
with output quality checked on a fixed sample set and every profile change rolled back."""
