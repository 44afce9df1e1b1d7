//! Reward functions: math-answer equivalence conformance against math-verify 0.9.0's own test
//! cases (tests/assets/math/answer-equivalence-cases.jsonl, every case must pass), and each
//! `--rm-type` on realistic completions. The deepscaler / math / dapo / f1 expected rewards are
//! slime's own (tests/fixtures/reward/slime_rewards.jsonl, from tests/fixtures/gen_reward_fixtures.py
//! over slime's rm_hub functions), with vime's deliberate differences listed by name and reason.
//! `remote_rm` runs against a local flaky server, a silent one and a dead port; its time bounds
//! come from the retry policy, not from a guess at the machine's speed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use vime_rollout::reward::boxed::{last_boxed_answer, last_boxed_only_string, remove_boxed};
use vime_rollout::reward::math::{self, ExtractConfig};
use vime_rollout::reward::{
    dapo, deepscaler, exact, f1, rule_reward, RemoteRmOptions, Reward, RewardModel, RewardSample, RmKind, RmType,
};

// ---- conformance ---------------------------------------------------------------------------

struct Case {
    gold: String,
    pred: String,
    equal: bool,
    source: String,
    match_types: Vec<String>,
}

fn load_cases() -> Vec<Case> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/assets/math/answer-equivalence-cases.jsonl"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1));
            let s = |k: &str| {
                v[k].as_str()
                    .unwrap_or_else(|| panic!("{path}:{}: missing {k}", i + 1))
                    .to_string()
            };
            Case {
                gold: s("gold"),
                pred: s("pred"),
                equal: v["equal"].as_bool().expect("equal is a bool"),
                source: s("source"),
                match_types: v["match_types"]
                    .as_array()
                    .expect("match_types")
                    .iter()
                    .map(|m| m.as_str().expect("string").to_string())
                    .collect(),
            }
        })
        .collect()
}

/// The extraction config the upstream test ran with: `compare_strings` uses
/// `LatexExtractionConfig(boxed_match_priority=0)`; `test_yujianll.py` uses the defaults.
fn config_for(case: &Case) -> ExtractConfig {
    let boxed_priority = if case.source.contains("test_yujianll.py") {
        50
    } else {
        0
    };
    ExtractConfig {
        latex: case.match_types.iter().any(|m| m == "latex"),
        expr: case.match_types.iter().any(|m| m == "expr"),
        boxed_priority,
    }
}

fn short(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= 160 {
        return format!("{s:?}");
    }
    let head: String = chars[..60].iter().collect();
    let tail: String = chars[chars.len() - 90..].iter().collect();
    format!("{head:?} ... {tail:?}")
}

#[test]
fn math_verify_conformance() {
    let cases = load_cases();
    assert_eq!(cases.len(), 267, "the vendored case file changed");
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let got = math::math_equal(&c.gold, &c.pred, &config_for(c));
        if got != c.equal {
            failures.push(i);
        }
    }
    let passed = cases.len() - failures.len();
    let rate = passed as f64 / cases.len() as f64;
    println!(
        "math-answer equivalence conformance: {passed}/{} = {:.2}%",
        cases.len(),
        100.0 * rate
    );
    for &i in &failures {
        let c = &cases[i];
        let test = c.source.rsplit("::").next().unwrap_or(&c.source);
        println!(
            "FAIL #{i} [{test}] expected equal={}:\n  gold: {}\n  pred: {}",
            c.equal,
            short(&c.gold),
            short(&c.pred)
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} math-verify cases fail (listed above); the README claims all {}",
        failures.len(),
        cases.len(),
        cases.len()
    );
}

// ---- answer equivalence on isolated answers ------------------------------------------------

#[test]
fn answer_equivalence_forms() {
    let yes = [
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{1}{2}", "\\dfrac{1}{2}"),
        ("\\frac{1}{2}", "1/2"),
        ("\\frac{3}{4}", "\\tfrac34"),
        ("2\\sqrt{3}", "\\sqrt{12}"),
        ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"),
        ("7425000", "7,425,000"),
        ("1000", "1 000"),
        ("18", "18.0"),
        ("18", "\\$18"),
        ("18", "18 dollars"),
        ("90", "90^\\circ"),
        ("28\\%", "28"),
        ("5", "x = 5"),
        ("5", "5."),
        ("\\pi", "\\pi"),
        ("2\\pi", "2 \\cdot \\pi"),
        ("\\frac{\\pi}{2}", "1.570796"),
        ("(1, 2)", "\\left( 1, 2 \\right)"),
        ("[0, 1)", "[0,1)"),
        ("\\{1, 2, 3\\}", "\\{3, 1, 2\\}"),
        ("x^2 + 2x + 1", "(x+1)^2"),
        ("\\frac{x+2}{7}", "\\frac{x}{7} + \\frac{2}{7}"),
        ("3x", "3 x"),
        ("\\text{Evelyn}", "Evelyn"),
        ("10\\text{ cm}", "10"),
        ("-\\frac{1}{3}", "-1/3"),
        ("1 \\pm \\sqrt{19}", "1 + \\sqrt{19}, 1 - \\sqrt{19}"),
    ];
    for (gold, pred) in yes {
        assert!(math::answers_equivalent(gold, pred), "{gold:?} should accept {pred:?}");
    }
    let no = [
        ("\\frac{1}{2}", "0.51"),
        ("\\frac{1}{3}", "0.333"),
        ("2", "\\frac{1+\\sqrt{5}}{2}"),
        ("(1, 2)", "(2, 1)"),
        ("[0, 1)", "(0, 1)"),
        ("x + 1", "x + 2"),
        ("5", "-5"),
        ("32349", "32, 349"),
        ("\\pm 2021", "2021"),
    ];
    for (gold, pred) in no {
        assert!(!math::answers_equivalent(gold, pred), "{gold:?} should reject {pred:?}");
    }
}

// ---- boxed extraction ----------------------------------------------------------------------

#[test]
fn boxed_extraction_edge_cases() {
    assert_eq!(last_boxed_answer("so \\boxed{18}."), Some("18".into()));
    assert_eq!(last_boxed_answer("\\boxed{1} and finally \\boxed{2}"), Some("2".into()));
    assert_eq!(
        last_boxed_answer("\\boxed{\\frac{\\sqrt{3}}{2}}"),
        Some("\\frac{\\sqrt{3}}{2}".into())
    );
    assert_eq!(last_boxed_answer("\\boxed{\\{1, 2\\}}"), Some("\\{1, 2\\}".into()));
    assert_eq!(last_boxed_answer("$\\boxed 42$"), Some("42".into()));
    assert_eq!(last_boxed_answer("\\fbox{7}"), Some("7".into()));
    assert_eq!(
        last_boxed_answer("\\boxed{3} then an unclosed \\boxed{4"),
        Some("3".into())
    );
    assert_eq!(last_boxed_answer("nothing boxed"), None);
    // slime's exact helpers
    assert_eq!(last_boxed_only_string("x \\boxed{a{b}c} y"), Some("\\boxed{a{b}c}"));
    assert_eq!(remove_boxed("\\boxed{a{b}c}"), Some("a{b}c"));
    assert_eq!(remove_boxed("\\fbox{7}"), None);
}

// ---- rule-based rewards --------------------------------------------------------------------

const GSM8K_RESPONSE: &str = "<think>Natalia sold 48 clips in April and half as many, 24, in May. \
48 + 24 = 72. Wait, the question asks for May only? No: altogether. So \\boxed{70} is wrong, it is 72.</think>\n\
Natalia sold $48$ clips in April and $48/2 = 24$ in May, so altogether she sold $48 + 24 = 72$ clips.\n\n\
The answer is $\\boxed{72}$.";

fn rm(s: &str) -> RmType {
    s.parse().expect("valid rm type")
}

fn scalar(r: Reward) -> f64 {
    r.value(None).expect("scalar reward")
}

#[test]
fn rm_type_parsing() {
    assert_eq!(
        rm("deepscaler"),
        RmType {
            kind: RmKind::Deepscaler,
            boxed: false
        }
    );
    assert_eq!(
        rm("boxed_f1"),
        RmType {
            kind: RmKind::F1,
            boxed: true
        }
    );
    assert_eq!(rm("boxed_f1").to_string(), "boxed_f1");
    let err = "gpqa".parse::<RmType>().unwrap_err().to_string();
    assert!(err.contains("not implemented") && err.contains("deepscaler"), "{err}");
}

// Expected values: tests/fixtures/reward/slime_rewards.jsonl, computed by slime's own rm_hub
// functions (tests/fixtures/gen_reward_fixtures.py, vendored code in tests/fixtures/slime_rm_hub).

struct SlimeCase {
    name: String,
    rm_type: String,
    response: String,
    label: Option<String>,
    /// A number, or dapo's `{"score", "acc", "pred"}`; `None` when slime raised.
    reward: Option<serde_json::Value>,
    error: Option<String>,
}

fn slime_cases() -> Vec<SlimeCase> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/reward/slime_rewards.jsonl"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1));
            if v.get("versions").is_some() {
                return None;
            }
            let s = |k: &str| v[k].as_str().map(str::to_string);
            Some(SlimeCase {
                name: s("name").expect("name"),
                rm_type: s("rm_type").expect("rm_type"),
                response: s("response").expect("response"),
                label: s("label"),
                reward: v.get("reward").cloned(),
                error: s("error"),
            })
        })
        .collect()
}

/// Cases where vime deliberately differs from slime, by (rm_type, case name): vime's value and why.
const DELIBERATE_DIFFERENCES: &[(&str, &str, f64, &str)] = &[
    (
        "deepscaler",
        "set order",
        1.0,
        "vime's grader adds math-verify equivalence (rollout/src/reward/deepscaler.rs, step 3), \
         which accepts a set in another order; slime's mathd/sympy graders compare in order",
    ),
    (
        "deepscaler",
        "unreduced fraction",
        1.0,
        "math-verify equivalence (deepscaler.rs step 3) accepts 2/4 = 1/2; slime's sympy grader \
         refuses an unreduced fraction",
    ),
    (
        "deepscaler",
        "fbox",
        1.0,
        "vime extracts the answer with last_boxed_answer, which reads \\fbox{} too; slime's \
         extract_answer needs a \\boxed",
    ),
];

/// Checks vime's `rule_reward` on every fixture case whose rm_type is in `rm_types`; returns how
/// many were checked.
fn check_slime_cases(rm_types: &[&str]) -> usize {
    let (mut checked, mut mismatches) = (0, Vec::new());
    for c in slime_cases().iter().filter(|c| rm_types.contains(&c.rm_type.as_str())) {
        let what = format!(
            "{} {:?} (response {:?}, label {:?})",
            c.rm_type, c.name, c.response, c.label
        );
        let got = rule_reward(rm(&c.rm_type), &c.response, c.label.as_deref());
        match (&c.reward, &c.error) {
            (_, Some(err)) => {
                let e = got
                    .err()
                    .unwrap_or_else(|| panic!("{what}: slime raises {err:?}, vime returned a reward"));
                println!("{what}: error as in slime ({err}): {e:#}");
            }
            (Some(serde_json::Value::Object(want)), None) => match got.unwrap() {
                Reward::Fields(m) => assert_eq!(&m, want, "{what}"),
                r => panic!("{what}: slime returns fields {want:?}, vime {r:?}"),
            },
            (Some(want), None) => {
                let want = want.as_f64().unwrap();
                let got = scalar(got.unwrap());
                match DELIBERATE_DIFFERENCES
                    .iter()
                    .find(|d| d.0 == c.rm_type && d.1 == c.name)
                {
                    Some(&(_, _, ours, why)) => {
                        assert_eq!(got, ours, "{what}: vime's deliberate value");
                        assert_ne!(want, ours, "{what}: no longer a difference from slime");
                        println!("{what}: slime {want}, vime {got}: {why}");
                    }
                    None if (got - want).abs() <= 1e-12 => {}
                    None => mismatches.push(format!("{what}: vime {got}, slime {want}")),
                }
            }
            (None, None) => panic!("{what}: fixture row has neither reward nor error"),
        }
        checked += 1;
    }
    assert!(
        mismatches.is_empty(),
        "differences from slime:\n{}",
        mismatches.join("\n")
    );
    assert!(checked > 0, "no fixture cases for {rm_types:?}");
    checked
}

#[test]
fn deepscaler_reward_cases() {
    assert!(check_slime_cases(&["deepscaler", "boxed_deepscaler"]) >= 29);
    assert_eq!(
        GSM8K_RESPONSE,
        slime_cases()[0].response,
        "the fixture's first response is GSM8K_RESPONSE"
    );
}

#[test]
fn math_reward_cases() {
    assert!(check_slime_cases(&["math", "boxed_math"]) >= 10);
}

#[test]
fn boxed_prefix_applies_to_the_boxed_answer() {
    assert!(check_slime_cases(&["f1", "boxed_f1"]) >= 5);
}

#[test]
fn dapo_reward_cases() {
    assert!(check_slime_cases(&["dapo"]) >= 10);
    // --reward-key picks the score.
    let r = rule_reward(rm("dapo"), "Answer: 42", Some("42")).unwrap();
    assert_eq!(r.value(Some("score")).unwrap(), 1.0);
    assert!(r.value(None).unwrap_err().to_string().contains("--reward-key"));
    // A non-numeric label is an error (slime raises, see the fixture), not a silent -1.
    let err = rule_reward(rm("dapo"), "Answer: x", Some("\\text{blue}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a number"), "{err}");
    assert_eq!(dapo::normalize_final_answer("\\text{5} dollars"), "5");
}

#[test]
fn f1_reward_cases() {
    let f = |p: &str, g: &str| f1::f1_score(p, g).0;
    assert_eq!(f("The Eiffel Tower", "eiffel tower"), 1.0);
    assert!((f("the big red barn", "red barn") - 0.8).abs() < 1e-12);
    assert_eq!(f("Paris.", "paris"), 1.0);
    assert_eq!(f("yes", "no"), 0.0);
    assert_eq!(f("no", "no"), 1.0);
    assert_eq!(f("no way", "no"), 0.0, "a yes/no label needs the exact answer");
    assert_eq!(f("completely different", "answer"), 0.0);
    let r = rule_reward(rm("f1"), "It was Marie Curie.", Some("Marie Curie")).unwrap();
    assert!((scalar(r) - 2.0 / 3.0).abs() < 1e-12);
    assert!(rule_reward(rm("f1"), "x", None).is_err());
    assert!(deepscaler::grade_answer("\\frac{1}{2}", "0.5"));
}

#[test]
fn exact_match_reward_cases() {
    assert_eq!(
        rm("exact_match"),
        RmType {
            kind: RmKind::ExactMatch,
            boxed: false
        }
    );
    assert_eq!(rm("exact_match").to_string(), "exact_match");
    assert_eq!(rm("boxed_exact_match").to_string(), "boxed_exact_match");
    let err = "gpqa".parse::<RmType>().unwrap_err().to_string();
    assert!(err.contains("exact_match"), "the supported list names it: {err}");

    let r = |resp: &str, label: &str| scalar(rule_reward(rm("exact_match"), resp, Some(label)).unwrap());
    assert_eq!(r("47", "47"), 1.0);
    assert_eq!(r(" 47\n", "47 "), 1.0, "surrounding whitespace on either side");
    assert_eq!(r("-3", "-3"), 1.0);
    assert_eq!(r("47<eos>", "47"), 1.0, "decoded with its EOS token");
    assert_eq!(r("47<|endoftext|>\n", "47"), 1.0);
    assert_eq!(r("47<eos><pad><pad>", "47"), 1.0);
    assert_eq!(r("47<|im_end|>", "47"), 1.0);
    assert_eq!(r("047", "47"), 0.0, "no numeric equivalence");
    assert_eq!(r("47.0", "47"), 0.0);
    assert_eq!(r("4 7", "47"), 0.0);
    assert_eq!(r("47 48", "47"), 0.0);
    assert_eq!(r("3", "-3"), 0.0);
    assert_eq!(r("<eos>47", "47"), 0.0, "only a trailing EOS is dropped");
    assert_eq!(r("", "47"), 0.0);
    assert_eq!(exact::strip_response(" 12 <eos>\n<pad>"), "12");

    let err = rule_reward(rm("exact_match"), "47", None).unwrap_err().to_string();
    assert!(err.contains("exact_match reward: the sample has no label"), "{err}");
    let boxed = rule_reward(rm("boxed_exact_match"), "so \\boxed{47}.", Some("47")).unwrap();
    assert_eq!(scalar(boxed), 1.0);
    assert_eq!(
        RewardModel::new("exact_match", None).unwrap().rm_type(),
        Some(rm("exact_match"))
    );
}

#[tokio::test]
async fn reward_model_dispatch_and_per_sample_type() {
    let model = RewardModel::new("deepscaler", None).unwrap();
    let samples = vec![
        RewardSample {
            response: GSM8K_RESPONSE.into(),
            label: Some("72".into()),
            ..Default::default()
        },
        RewardSample {
            response: "<think></think>\\boxed{1}".into(),
            label: Some("2".into()),
            ..Default::default()
        },
        RewardSample {
            response: "Answer: 9".into(),
            label: Some("9".into()),
            rm_type: Some("dapo".into()),
            ..Default::default()
        },
    ];
    let rewards = model.score_batch(&samples).await.unwrap();
    assert_eq!(rewards[0], Reward::Scalar(1.0));
    assert_eq!(rewards[1], Reward::Scalar(0.0));
    assert_eq!(rewards[2].value(Some("score")).unwrap(), 1.0);
    assert!(RewardModel::new("remote_rm", None)
        .unwrap_err()
        .to_string()
        .contains("--rm-url"));
}

// ---- remote_rm -----------------------------------------------------------------------------

/// A one-route HTTP server (axum) on 127.0.0.1:0 that answers 503 to the first `fail_first`
/// requests, then `reply`. Records every request body.
async fn flaky_server(fail_first: usize, reply: &'static str) -> (String, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    use axum::extract::State;
    use axum::http::{header, StatusCode};

    #[derive(Clone)]
    struct St {
        hits: Arc<AtomicUsize>,
        bodies: Arc<Mutex<Vec<String>>>,
        fail_first: usize,
        reply: &'static str,
    }
    async fn handler(
        State(st): State<St>,
        body: String,
    ) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
        st.bodies.lock().unwrap().push(body);
        let k = st.hits.fetch_add(1, Ordering::SeqCst);
        let json = [(header::CONTENT_TYPE, "application/json")];
        if k < st.fail_first {
            (StatusCode::SERVICE_UNAVAILABLE, json, "busy".into())
        } else {
            (StatusCode::OK, json, st.reply.into())
        }
    }

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    let st = St {
        hits: Arc::new(AtomicUsize::new(0)),
        bodies: Arc::new(Mutex::new(Vec::new())),
        fail_first,
        reply,
    };
    let (hits, bodies) = (st.hits.clone(), st.bodies.clone());
    let app = axum::Router::new()
        .route("/reward", axum::routing::post(handler))
        .with_state(st);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, hits, bodies)
}

fn fast_retries(attempts: u32) -> RemoteRmOptions {
    RemoteRmOptions {
        timeout: Duration::from_secs(2),
        max_attempts: attempts,
        backoff_base: Duration::from_millis(10),
        backoff_cap: Duration::from_millis(50),
    }
}

#[tokio::test]
async fn remote_rm_retries_until_the_server_answers() {
    let (url, hits, bodies) = flaky_server(3, "0.75").await;
    let model = RewardModel::with_remote_options("remote_rm", Some(&url), fast_retries(5)).unwrap();
    let sample = RewardSample {
        prompt: serde_json::json!([{"role": "user", "content": "What is 6*7?"}]),
        response: "42".into(),
        label: Some("42".into()),
        rm_type: None,
    };
    let reward = model.score(&sample).await.unwrap();
    assert_eq!(reward, Reward::Scalar(0.75));
    assert_eq!(hits.load(Ordering::SeqCst), 4, "three failures, then success");
    let body: serde_json::Value = serde_json::from_str(&bodies.lock().unwrap()[3]).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"prompt": sample.prompt, "response": "42", "label": "42"})
    );
}

#[tokio::test]
async fn remote_rm_dict_reply_and_reward_key() {
    let (url, _, _) = flaky_server(0, r#"{"score": 1.0, "acc": true}"#).await;
    let model = RewardModel::with_remote_options("remote_rm", Some(&url), fast_retries(2)).unwrap();
    let r = model
        .score(&RewardSample {
            response: "x".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.value(Some("score")).unwrap(), 1.0);
    assert_eq!(r.value(Some("acc")).unwrap(), 1.0);
    assert!(r.value(Some("missing")).is_err());
}

#[tokio::test]
async fn remote_rm_gives_up_with_the_url_in_the_error() {
    // Still failing after every attempt.
    let (url, hits, _) = flaky_server(100, "1").await;
    let model = RewardModel::with_remote_options("remote_rm", Some(&url), fast_retries(3)).unwrap();
    let err = model.score(&RewardSample::default()).await.unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains(&url) && msg.contains("3 attempts") && msg.contains("503"),
        "{msg}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 3);

    // A dead port: connection refused on every attempt, in bounded time.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/reward", l.local_addr().unwrap())
    };
    let opts = fast_retries(4);
    let model = RewardModel::with_remote_options("remote_rm", Some(&dead), opts.clone()).unwrap();
    let started = Instant::now();
    let err = model.score(&RewardSample::default()).await.unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains(&dead) && msg.contains("4 attempts"), "{msg}");
    assert!(
        msg.to_lowercase().contains("connect"),
        "the error names the cause: {msg}"
    );
    // Bounded by the policy, not by a guess at the machine's speed: even if every attempt had
    // run into its timeout, 4 attempts and 3 capped backoffs take at most this long.
    let took = started.elapsed();
    assert!(took <= policy_bound(&opts), "gave up in {took:?}");
}

/// The longest `opts` can take to give up (every attempt timing out, every backoff at its cap
/// plus jitter), plus slack for a loaded machine.
fn policy_bound(opts: &RemoteRmOptions) -> Duration {
    let n = opts.max_attempts;
    opts.timeout * n + opts.backoff_cap.mul_f64(1.1) * (n - 1) + Duration::from_secs(30)
}

#[tokio::test]
async fn remote_rm_times_out_a_silent_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock); // accept and never answer
        }
    });
    let opts = RemoteRmOptions {
        timeout: Duration::from_millis(200),
        max_attempts: 2,
        backoff_base: Duration::from_millis(10),
        backoff_cap: Duration::from_millis(10),
    };
    let model = RewardModel::with_remote_options("remote_rm", Some(&url), opts.clone()).unwrap();
    let started = Instant::now();
    let err = model.score(&RewardSample::default()).await.unwrap_err();
    let took = started.elapsed();
    let msg = format!("{err:#}");
    assert!(msg.contains(&url) && msg.contains("2 attempts"), "{msg}");
    assert!(msg.contains("timed out"), "the error names the timeout: {msg}");
    // The per-attempt timeout is what ended each attempt: both waited it out, and nothing more
    // than the policy allows.
    assert!(took >= opts.timeout * 2, "gave up after {took:?}, before 2 timeouts");
    assert!(took <= policy_bound(&opts), "gave up in {took:?}");
}

/// Degenerate generations (repetition loops, unclosed delimiters, deep nesting) must neither
/// crash nor stall the grader.
#[test]
fn degenerate_inputs_stay_fast() {
    let cfg = ExtractConfig::default();
    let cases: Vec<(&str, String)> = vec![
        ("nested calls", format!("${}x{}$", "f(".repeat(30), ")".repeat(30))),
        ("long sum", format!("The answer is {} 1", "1 + ".repeat(5000))),
        ("digit run", format!("x {}", "1 2 ".repeat(5000))),
        ("many dollars", "$a$ ".repeat(3000)),
        ("unclosed display math", "$$ x ".repeat(2000)),
        (
            "big set",
            format!(
                "$\\boxed{{{}}}$",
                (0..2000).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
            ),
        ),
        ("deep parens", format!("${}1{}$", "(".repeat(5000), ")".repeat(5000))),
        (
            "deep braces",
            format!("\\boxed{{{}1{}}}", "{".repeat(5000), "}".repeat(5000)),
        ),
        (
            "long display",
            format!("$$ {} $$", "\\frac{1}{2} + x^2 \\cdot ".repeat(2000)),
        ),
    ];
    for (name, text) in cases {
        let started = Instant::now();
        let _ = math::math_equal(&text, "$1$", &cfg);
        let _ = math::answers_equivalent(&text, "1");
        let _ = rule_reward(rm("deepscaler"), &format!("<think></think>{text}"), Some("1")).unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "{name}: {took:?}");
    }
    // Large integers compare exactly, not within a float tolerance.
    assert!(!math::answers_equivalent("1000000000001", "1000000000000"));
    assert!(math::answers_equivalent(
        "123456789012345678901",
        "123456789012345678901"
    ));
}

/// Differential check against the real math-verify 0.9.0 on pairs it has labelled
/// (see tests/assets/math/README-equivalence.md for the generator):
/// `MATH_VERIFY_PAIRS=/path/pairs.jsonl cargo test -p vime-rollout --test reward -- --ignored`.
#[test]
#[ignore = "needs pairs labelled by a math-verify 0.9.0 venv (MATH_VERIFY_PAIRS); see tests/assets/math/README-equivalence.md"]
fn differential_against_math_verify() {
    let Ok(path) = std::env::var("MATH_VERIFY_PAIRS") else {
        println!("MATH_VERIFY_PAIRS is not set; nothing to compare");
        return;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let cfg = ExtractConfig {
        latex: true,
        expr: true,
        boxed_priority: 0,
    };
    let (mut agree, mut total) = (0, 0);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let Some(expected) = v["equal"].as_bool() else { continue };
        let (g, p) = (v["gold"].as_str().unwrap(), v["pred"].as_str().unwrap());
        total += 1;
        if math::math_equal(g, p, &cfg) == expected {
            agree += 1;
        } else {
            println!("DIFF expected {expected}:\n  gold: {}\n  pred: {}", short(g), short(p));
        }
    }
    println!("agreement with math-verify: {agree}/{total}");
    assert_eq!(agree, total);
}
