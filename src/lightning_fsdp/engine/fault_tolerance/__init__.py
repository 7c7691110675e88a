"""Fault tolerance on the replicated axis (issue 44; docs/design/fault-tolerance.md): replica groups, each its own
torch world sharding the model with FSDP2, averaged and healed across groups through torchft.

- ``lighthouse``: torchft's quorum server, served by ``lightning-fsdp lighthouse``;
- ``config``: the argument and its checks; ``group``: ``ReplicaGroup``; ``data``: the cursor sampler over all groups;
- ``transport``: the heal wire, a JSON header plus raw tensor bytes over a process group; nothing is unpickled;
- ``heal``: the payload of a group rank (model shards, optimizer, LR schedulers, loop position, strategy and manager
  state), its loader, and the layout digest that refuses a payload of another layout before any byte is applied.

May import: ``lightning_fsdp._base``, ``lightning_fsdp.engine``, torch; torchft only inside functions, so that the
package imports without it. Never ``checkpoint``, the features or the fronts.
"""
