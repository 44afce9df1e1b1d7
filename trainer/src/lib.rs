//! vime-trainer: everything around the model that makes it train (batching, losses, optimizer,
//! checkpoints, the RL loop; built issue by issue) and the `vime-train` binary.
//!
//! Built so far: [`score`], the `vime-train logprobs` scoring command.
pub mod device;
pub mod score;
