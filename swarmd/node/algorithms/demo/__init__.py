"""DeMo (Peng et al. 2024, decoupled momentum): every inner step, each member's top DCT
components are all-gathered in a sticky group (gather.py, each payload signed: gather_sign.py).
Not the `swarmd demo` command, which is cli/showcase.py."""
