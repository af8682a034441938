"""Ray cluster launcher node providers that Ray's autoscaler loads from raytrain.

Each module is named in a cluster YAML as `provider: {type: external, module: ...}` and runs in
`ray up` (on your machine) and in the autoscaler on the head node, never in training workers.
`azure.py`: Ray's Azure provider with every InfiniBand worker in one availability set
(cluster/ib.yaml). Importing this package imports no cloud SDK.
"""
