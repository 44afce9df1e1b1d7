//! vime-rollout: prompt datasets, chat templates, rewards and the rollout engines (built-in and
//! vLLM). Not built yet: see the rollout-side issue. The crate exists so the workspace layout is
//! the agreed one from the first commit.
