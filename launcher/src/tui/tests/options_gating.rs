//! Options the selected backend or this machine cannot use are shown
//! disabled, with the reason from the capability report, and do not change.

use super::*;
use crate::tui::fields::Field;

fn options(gpu: bool) -> App {
    let mut a = app(gpu);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter]);
    assert_eq!(a.screen, Screen::Options);
    a
}

#[test]
fn without_a_gpu_the_gpu_settings_are_disabled_with_the_reason() {
    let mut a = options(false);
    let s = screen_text(&a, 140, 30);
    let row = |name: &str| s.lines().find(|l| l.contains(name)).unwrap().to_string();
    for f in ["VRAM limit", "Safety margin", "GPU (CUDA device)"] {
        assert!(
            row(f).contains(
                "n/a: a GPU setting, and the cuda backend cannot run here: no NVIDIA driver"
            ),
            "{}\n{s}",
            row(f)
        );
    }
    assert!(
        row("HCS").contains("n/a: HCS keeps experts in GPU memory and needs the cuda backend"),
        "{s}"
    );
    // Not editable: Enter explains instead of opening an editor.
    at(&mut a, Field::VramLimit);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.editing, None);
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("VRAM limit: not available")
    );
    at(&mut a, Field::Hcs);
    key(&mut a, KeyCode::Right);
    assert!(!a.opts.hcs);
    let s = screen_text(&a, 100, 30);
    assert!(
        s.contains("HCS (hot experts in VRAM) is not available"),
        "{s}"
    );
}

#[test]
fn the_reference_backend_disables_gpu_settings_on_a_gpu_machine() {
    let mut a = options(true);
    at(&mut a, Field::VramLimit);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "20GiB");
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.vram_limit_bytes, Some(20 << 30));
    at(&mut a, Field::Gpu);
    key(&mut a, KeyCode::Right);
    assert_eq!(a.opts.gpu, 0, "the one probed GPU");
    at(&mut a, Field::Backend);
    key(&mut a, KeyCode::Right);
    assert_eq!(a.opts.backend, Backend::Reference);
    assert_eq!(
        a.opts.vram_limit_bytes, None,
        "a limit the CPU cannot use is dropped"
    );
    assert!(!a.opts.hcs);
    let s = screen_text(&a, 140, 30);
    let vram = s.lines().find(|l| l.contains("VRAM limit")).unwrap();
    assert!(
        vram.contains("n/a: a GPU setting; the reference backend runs on the CPU"),
        "{s}"
    );
    // Back to cuda: usable again.
    key(&mut a, KeyCode::Right);
    assert_eq!(a.opts.backend, Backend::Cuda);
    at(&mut a, Field::VramLimit);
    key(&mut a, KeyCode::Enter);
    assert!(a.editing.is_some());
}

#[test]
fn the_summary_does_not_show_gpu_settings_as_if_they_applied() {
    // No GPU: the default backend is the reference one; Tab to the summary.
    let mut a = options(false);
    key(&mut a, KeyCode::Tab);
    assert_eq!(a.screen, Screen::Summary);
    let s = screen_text(&a, 140, 40);
    let row = |name: &str| s.lines().find(|l| l.contains(name)).unwrap().to_string();
    for f in ["VRAM limit", "Safety margin"] {
        assert!(row(f).contains("n/a:"), "{}\n{s}", row(f));
        assert!(!row(f).contains("whole GPU"), "{}", row(f));
    }
}

#[test]
fn only_backends_that_build_the_family_are_offered() {
    let caps = crate::runtime::tests::fake_caps(true);
    let choices = |model_type| {
        Field::Backend.choices(
            &krasis_common::LaunchOptions::default(),
            crate::tui::fields::FieldCtx {
                caps: &caps,
                model_type,
                gpus: &[],
            },
        )
    };
    assert_eq!(choices(Some("qwen3_moe")), ["reference", "cuda"]);
    assert_eq!(choices(Some("gpt_oss")), ["reference", "cuda"]);
    let d = caps.default_options("gpt_oss").unwrap();
    assert_eq!((d.backend, d.hcs), (Backend::Cuda, true));
    assert_eq!(d.expert_precision, "mxfp4");
    // glm4_moe: both engines, the CUDA one from the INT4 cache with HCS.
    assert_eq!(choices(Some("glm4_moe")), ["reference", "cuda"]);
    let d = caps.default_options("glm4_moe").unwrap();
    assert_eq!((d.backend, d.hcs), (Backend::Cuda, true));
    assert_eq!(d.expert_precision, "int4");
    // A family registered with the reference engine only is offered only it.
    let mut one = caps.clone();
    one.architectures
        .iter_mut()
        .find(|a| a.model_type == "gpt_oss")
        .unwrap()
        .backends
        .retain(|b| b == "reference");
    let only = Field::Backend.choices(
        &krasis_common::LaunchOptions::default(),
        crate::tui::fields::FieldCtx {
            caps: &one,
            model_type: Some("gpt_oss"),
            gpus: &[],
        },
    );
    assert_eq!(only, ["reference"]);
}

/// The batching fields follow the selected backend's capability: Parallel
/// cycles through auto and 1 to its `max_parallel`, the KV budget is typed
/// only where the backend takes one; switching to a backend that cannot
/// do them drops them.
#[test]
fn batching_fields_follow_the_backend() {
    let caps = crate::runtime::tests::fake_caps(true);
    let cx = crate::tui::fields::FieldCtx {
        caps: &caps,
        model_type: Some("qwen3_moe"),
        gpus: &[],
    };
    let mut o = krasis_common::LaunchOptions {
        backend: Backend::Reference,
        hcs: false,
        ..Default::default()
    };
    let c = Field::Parallel.choices(&o, cx);
    assert_eq!(c.len(), 9, "{c:?}");
    assert_eq!(Field::Parallel.show(&o), c[0]);
    Field::Parallel.cycle(&mut o, cx, true);
    assert_eq!(o.parallel, Some(1));
    Field::Parallel.cycle(&mut o, cx, false);
    Field::Parallel.cycle(&mut o, cx, false);
    assert_eq!(o.parallel, Some(8));
    assert_eq!(Field::KvTokens.unavailable(&o, cx), None);
    Field::KvTokens.set_text(&mut o, "65536").unwrap();
    assert_eq!(o.kv_tokens, Some(65536));
    assert!(Field::KvTokens.set_text(&mut o, "0").is_err());
    caps.check_options(&o, "qwen3_moe").unwrap();
    // To cuda, which batches as many and takes a KV budget: both kept.
    let mut to_cuda = o.clone();
    while to_cuda.backend != Backend::Cuda {
        Field::Backend.cycle(&mut to_cuda, cx, true);
    }
    assert_eq!(
        (to_cuda.parallel, to_cuda.kv_tokens),
        (Some(8), Some(65536))
    );
    // To a backend that runs one request at a time without a KV budget:
    // both are dropped.
    let mut single = caps.clone();
    single.set_batching(Backend::Cuda, 1, false);
    let cx = crate::tui::fields::FieldCtx {
        caps: &single,
        ..cx
    };
    while o.backend != Backend::Cuda {
        Field::Backend.cycle(&mut o, cx, true);
    }
    assert_eq!((o.parallel, o.kv_tokens), (None, None));
    assert_eq!(Field::Parallel.choices(&o, cx).len(), 2);
    assert!(Field::KvTokens.unavailable(&o, cx).is_some());
}
