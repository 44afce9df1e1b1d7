//! vime-sync: weight streaming from the trainer to rollout engines (bucket planner, NCCL and
//! CUDA-IPC transports). Not built yet: see the weight-sync work. The crate exists so the
//! workspace layout is the agreed one from the first commit.
