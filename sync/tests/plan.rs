//! The bucket planner against plans worked out by hand (the numbers in the comments), for
//! Qwen3-4B's shapes and the HF fixture model, and a bucket read back by the `safetensors` crate.
use candle_core::{DType, Device, Tensor};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use vime_dist::layout::{LayoutEntry, LayoutTable};
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::state_dict::param_specs;
use vime_sync::{BucketRule, SyncPlan, DEFAULT_BUFFER_BYTES};

fn table(cfg: &Qwen3Config) -> LayoutTable {
    let entries = param_specs(cfg)
        .into_iter()
        .map(|s| LayoutEntry::new(s.name, &s.shape, DType::BF16, false, s.placement))
        .collect();
    LayoutTable::new(entries, 0, 1).unwrap()
}

fn names(plan: &SyncPlan, b: usize) -> Vec<String> {
    plan.buckets[b].tensors.iter().map(|t| t.name.clone()).collect()
}

const L2: &str = "model.layers.2";

#[test]
fn qwen3_4b_in_512_mib_buckets() {
    let cfg = Qwen3Config::preset("qwen3-4b").unwrap();
    // bf16 bytes by hand: embed [151936, 2560] = 777,912,320 (> 512 MiB = 536,870,912, a bucket
    // of its own). One layer: norms 2 x 5,120, q/k norms 2 x 256, q and o [4096, 2560] 2 x
    // 20,971,520, k and v [1024, 2560] 2 x 5,242,880, gate/up/down [9728, 2560] 3 x 49,807,360:
    // 201,861,632. Tied: no lm_head.
    let plan = SyncPlan::new(&table(&cfg), DType::BF16, DEFAULT_BUFFER_BYTES, BucketRule::CloseBefore).unwrap();
    assert_eq!(names(&plan, 0), ["model.embed_tokens.weight"]);
    assert_eq!(plan.buckets[0].nbytes, 777_912_320);
    // Bucket 1: layers 0 and 1 (403,723,264), then layer 2's norm, q/k/v/o and q/k norms
    // (52,439,552) and gate (49,807,360): 505,970,176; up would make 555,777,536 > 536,870,912.
    let b1 = names(&plan, 1);
    assert_eq!(b1.first().unwrap(), "model.layers.0.input_layernorm.weight");
    assert_eq!(b1.last().unwrap(), &format!("{L2}.mlp.gate_proj.weight"));
    assert_eq!(b1.len(), 11 + 11 + 9);
    assert_eq!(plan.buckets[1].nbytes, 505_970_176);
    // Offsets are back to back: gate_proj of layer 2 starts right after its post-attention norm.
    let gate = plan.buckets[1].tensors.last().unwrap();
    assert_eq!((gate.begin, gate.end), (456_162_816, 505_970_176));
    assert_eq!(names(&plan, 2)[0], format!("{L2}.mlp.up_proj.weight"));
    // No bucket but the embedding's passes the buffer; every parameter exactly once, in order;
    // 4,022,468,096 parameters x 2 bytes.
    assert!(plan.buckets[1..].iter().all(|b| b.nbytes <= DEFAULT_BUFFER_BYTES));
    assert_eq!(plan.num_tensors(), 1 + 36 * 11 + 1);
    assert_eq!(plan.total_bytes(), 8_044_936_192);
    let last = plan.buckets.last().unwrap().tensors.last().unwrap();
    assert_eq!(last.name, "model.norm.weight");
    let all: Vec<String> = (0..plan.buckets.len()).flat_map(|b| names(&plan, b)).collect();
    let want: Vec<String> = param_specs(&cfg).into_iter().map(|s| s.name).collect();
    assert_eq!(all, want);

    // vLLM's packed rule closes AFTER the tensor that passes the size: bucket 1 also takes up_proj
    // (555,777,536 > 536,870,912).
    let packed = SyncPlan::new(&table(&cfg), DType::BF16, DEFAULT_BUFFER_BYTES, BucketRule::CloseAfter).unwrap();
    assert_eq!(names(&packed, 0), ["model.embed_tokens.weight"]);
    assert_eq!(names(&packed, 1).last().unwrap(), &format!("{L2}.mlp.up_proj.weight"));
    assert_eq!(packed.buckets[1].nbytes, 555_777_536);
    assert_eq!(packed.total_bytes(), 8_044_936_192);
}

fn fixture_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf/tied_gqa"))
}

#[test]
fn the_fixture_model_in_32_kib_buckets() {
    let cfg = vime_qwen3::checkpoint::load_config(fixture_dir()).unwrap();
    // bf16 bytes: embed [160, 64] 20,480; per layer: input norm 128, q [128, 64] 16,384, k and v
    // [64, 64] 8,192 each, o [64, 128] 16,384, q/k norms 64 each, post norm 128, gate/up/down
    // [96, 64] 12,288 each (86,400 per layer); final norm 128. Total 193,408.
    let plan = SyncPlan::new(&table(&cfg), DType::BF16, 32 << 10, BucketRule::CloseBefore).unwrap();
    let l = |i: usize, s: &str| format!("model.layers.{i}.{s}");
    let layer_tail = |i: usize| {
        vec![
            l(i, "self_attn.o_proj.weight"),
            l(i, "self_attn.q_norm.weight"),
            l(i, "self_attn.k_norm.weight"),
            l(i, "post_attention_layernorm.weight"),
            l(i, "mlp.gate_proj.weight"),
        ]
    };
    let qkv = |i: usize| {
        vec![
            l(i, "self_attn.q_proj.weight"),
            l(i, "self_attn.k_proj.weight"),
            l(i, "self_attn.v_proj.weight"),
        ]
    };
    let expected: Vec<(Vec<String>, usize)> = vec![
        (
            vec!["model.embed_tokens.weight".into(), l(0, "input_layernorm.weight")],
            20_608,
        ),
        (qkv(0), 32_768), // exactly full: closed
        (layer_tail(0), 28_928),
        (
            vec![
                l(0, "mlp.up_proj.weight"),
                l(0, "mlp.down_proj.weight"),
                l(1, "input_layernorm.weight"),
            ],
            24_704,
        ),
        (qkv(1), 32_768),
        (layer_tail(1), 28_928),
        (
            vec![
                l(1, "mlp.up_proj.weight"),
                l(1, "mlp.down_proj.weight"),
                "model.norm.weight".into(),
            ],
            24_704,
        ),
    ];
    assert_eq!(plan.buckets.len(), expected.len());
    for (b, (want, bytes)) in expected.iter().enumerate() {
        assert_eq!(&names(&plan, b), want, "bucket {b}");
        assert_eq!(plan.buckets[b].nbytes, *bytes, "bucket {b} bytes");
    }
    assert_eq!(plan.total_bytes(), 193_408);
    assert_eq!(
        plan.buckets[1].update_info(),
        json!({
            "names": qkv(0),
            "dtype_names": ["bfloat16", "bfloat16", "bfloat16"],
            "shapes": [[128, 64], [64, 64], [64, 64]],
        })
    );
}

/// A bucket's bytes packed as the plan says, behind its header, read by the `safetensors` crate:
/// the same names, dtypes, shapes and bytes as the fixture model's tensors cast to bf16.
#[test]
fn a_bucket_is_a_safetensors_file() {
    let dir = fixture_dir();
    let cfg = vime_qwen3::checkpoint::load_config(dir).unwrap();
    let tensors: BTreeMap<String, Tensor> = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    let plan = SyncPlan::new(&table(&cfg), DType::BF16, 32 << 10, BucketRule::CloseBefore).unwrap();
    let bytes_of = |name: &str| -> Vec<u8> {
        let t = tensors[name].to_dtype(DType::BF16).unwrap().flatten_all().unwrap();
        t.to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    };
    for bucket in &plan.buckets {
        let mut file = bucket.safetensors_header();
        assert_eq!(file.len() % 8, 0);
        for t in &bucket.tensors {
            assert_eq!(
                file.len() - bucket.safetensors_header().len(),
                t.begin,
                "{} is not back to back",
                t.name
            );
            file.extend(bytes_of(&t.name));
        }
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.len(), bucket.tensors.len());
        for t in &bucket.tensors {
            let view = st.tensor(&t.name).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::BF16);
            assert_eq!(view.shape(), t.shape.as_slice());
            assert_eq!(view.data(), bytes_of(&t.name).as_slice(), "{}", t.name);
        }
    }
}

#[test]
fn a_zero_buffer_is_refused() {
    let cfg = vime_qwen3::checkpoint::load_config(fixture_dir()).unwrap();
    let e = SyncPlan::new(&table(&cfg), DType::BF16, 0, BucketRule::CloseBefore).unwrap_err();
    assert!(e.to_string().contains("--update-weight-buffer-size"), "{e}");
}

/// The boundary cases of both rules on hand-sized tensors (bf16, so 2 bytes per element): a
/// bucket of exactly the buffer size closes under CloseBefore but stays open under vLLM's strict
/// `>` rule; one tensor larger than the buffer is a bucket of its own.
#[test]
fn exact_fit_and_oversized_tensors() {
    use vime_dist::layout::Placement;
    let sizes = [4usize, 4, 2, 20, 1, 3];
    let entries = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| LayoutEntry::new(format!("t{i}"), &[*n], DType::BF16, false, Placement::Replicated))
        .collect();
    let t = LayoutTable::new(entries, 0, 1).unwrap();
    let groups = |p: &SyncPlan| -> Vec<Vec<String>> {
        p.buckets
            .iter()
            .map(|b| b.tensors.iter().map(|s| s.name.clone()).collect())
            .collect()
    };
    // Buffer 16 bytes = 8 elements.
    let before = SyncPlan::new(&t, DType::BF16, 16, BucketRule::CloseBefore).unwrap();
    assert_eq!(
        groups(&before),
        [vec!["t0", "t1"], vec!["t2"], vec!["t3"], vec!["t4", "t5"]]
    );
    assert_eq!(
        before.buckets.iter().map(|b| b.nbytes).collect::<Vec<_>>(),
        [16, 4, 40, 8]
    );
    let after = SyncPlan::new(&t, DType::BF16, 16, BucketRule::CloseAfter).unwrap();
    assert_eq!(groups(&after), [vec!["t0", "t1", "t2"], vec!["t3"], vec!["t4", "t5"]]);
    assert_eq!(after.buckets[0].tensors[2].begin, 16);
    assert_eq!(after.buckets.iter().map(|b| b.nbytes).collect::<Vec<_>>(), [20, 40, 8]);
}
