"""DiLoCo (Douillard et al. 2023): H inner steps, then one outer step on the group's averaged
pseudo-gradient (the loop is ../loop.py; the all-reduce is swarmd/node/averaging)."""
