"""Starting processes: `paralm train --nproc N` through torchrun, fault-tolerant replica groups, and the
lifeline that makes workers die with their launcher."""
