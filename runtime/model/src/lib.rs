//! Model-side building blocks of krasis-runtime: checkpoint loading with typed
//! per-architecture configs and tensor names, tokenizer and chat template,
//! synthetic checkpoints, and the CPU reference engine (the oracle the GPU
//! engine is checked against).

pub mod arch;
pub mod atomic;
pub mod batch;
pub mod chat_template;
pub mod checkpoint;
pub mod engine;
pub mod error;
pub mod experts;
pub mod formats;
pub mod layers;
pub mod prefix_cache;
pub mod reference;
pub mod sampling;
pub mod structured;
pub mod synth;
pub mod testutil;
pub mod tokenizer;

pub use arch::{ExpertStorage, FusedMxfp4Names, Geometry, MlpKind, ModelConfig};
pub use batch::{Admission, Batch, KvUsage, SeqEvent, SeqId};
pub use checkpoint::{Checkpoint, DType, TensorView};
pub use engine::{
    CancelToken, Engine, EngineError, EngineInfo, FinishReason, GenerateOutcome, GenerateRequest,
    GenerateStats, LiveProgress, SamplingParams,
};
pub use error::ModelError;
pub use experts::{ExpertBias, ExpertF32, ExpertWeights};
pub use formats::{Mxfp4Error, Mxfp4Matrix, Mxfp4Shape, Mxfp4Tensor};
