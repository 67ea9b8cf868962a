"""Beyond one device: tensor parallelism (`sharding`, `plan`: meshes, sharded
params and caches, programs placed on a mesh) and prefill/decode
disaggregation (`disagg`: prefill workers, KV page transfer, the decode
side's scheduler)."""
