"""The data-parallel router (``sglite router``, ``sglite serve --dp-size N``): a cache-aware proxy
in front of N worker servers, and prefill/decode pairing for disaggregated serving.

Modules: app (the proxy app, ``RouterThread``), policy (``RouterConfig``, ``Policy``), approx_tree
(the per-worker character radix tree), cli (flags, ``serve_data_parallel``), pd (prefill/decode
pairing), placement (colocated vs disaggregated goodput estimate). Import submodules directly.
"""
