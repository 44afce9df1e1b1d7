//! Synthetic tasks: the char tokenizer through the crate's `Tokenizer` (ids, round trips, special
//! tokens, unknown characters), and the arithmetic task's files (determinism, right answers,
//! disjoint train/eval, digit ranges, loading through `PromptDataset`).
//!
//! Python `transformers` loading the same files is checked by hand (see the module doc of
//! `vime_rollout::task::char_tokenizer`); these tests cannot run Python.
use std::collections::HashSet;
use std::path::Path;

use vime_kernels::testing::Rng;
use vime_rollout::data::{DataArgs, PromptDataset, Tokenizer};
use vime_rollout::reward::{rule_reward, Reward};
use vime_rollout::task::arith::{EOS_TOKEN, PAD_TOKEN};
use vime_rollout::task::{write_char_tokenizer, write_task, ArithTask};

/// Evaluates `"<a><op><b>="` independently of the task code: the operator is the first `+ - *`
/// after the first character (so a leading operand is never read as a sign).
fn evaluate(prompt: &str) -> (i64, char, i64, i64) {
    let body = prompt.strip_suffix('=').expect("prompt ends with '='");
    let at = body
        .char_indices()
        .skip(1)
        .find(|(_, c)| "+-*".contains(*c))
        .map(|(i, _)| i)
        .expect("an operator");
    let op = body[at..].chars().next().unwrap();
    let a: i64 = body[..at].parse().expect("left operand");
    let b: i64 = body[at + 1..].parse().expect("right operand");
    let value = match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        _ => unreachable!(),
    };
    (a, op, b, value)
}

fn read_rows(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["input"].as_str().unwrap().to_string(),
                v["label"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn digits(n: i64) -> u32 {
    n.unsigned_abs().to_string().len() as u32
}

#[test]
fn char_tokenizer_ids_round_trip_and_special_tokens() {
    let dir = tempfile::tempdir().unwrap();
    write_char_tokenizer(dir.path(), "0123456789+=", &[EOS_TOKEN, PAD_TOKEN]).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();

    assert_eq!(tok.vocab_size(), 14);
    assert_eq!(tok.eos_token_id(), Some(0));
    assert_eq!(tok.pad_token_id(), Some(1));
    assert_eq!(tok.special_token("bos_token"), None);
    assert!(tok.chat_template(false).is_err(), "no chat template");
    // '0'..'9' are 2..=11, '+' 12, '=' 13.
    let ids = tok.encode("12+35=").unwrap();
    assert_eq!(ids, vec![3, 4, 12, 5, 7, 13]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "12+35=");
    assert_eq!(tok.id_to_token(12).as_deref(), Some("+"));

    // No special tokens are added, special-token text encodes to its id, and decoding can skip it.
    let ids = tok.encode("47<eos>").unwrap();
    assert_eq!(ids, vec![6, 9, 0]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "47");
    assert_eq!(tok.decode(&ids, false).unwrap(), "47<eos>");
    assert_eq!(tok.decode(&[6, 9, 0, 1, 1], true).unwrap(), "47");

    // An unknown character is an error at encode time (documented choice: no <unk>).
    let err = tok.encode("1-2=").unwrap_err().to_string();
    assert!(err.contains("UNK"), "{err}");
    assert!(tok.encode("1 2").is_err(), "space is not in this vocabulary");
}

#[test]
fn char_tokenizer_keeps_spaces_and_newlines() {
    let dir = tempfile::tempdir().unwrap();
    write_char_tokenizer(dir.path(), "ab \n", &["<|endoftext|>"]).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.vocab_size(), 5);
    assert_eq!(tok.eos_token_id(), Some(0));
    assert_eq!(tok.pad_token_id(), Some(0), "one special token is both eos and pad");
    for s in ["a b", "  ab  ", "a\nb \n", " "] {
        let ids = tok.encode(s).unwrap();
        assert_eq!(ids.len(), s.chars().count(), "{s:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), s);
    }
    assert_eq!(tok.encode("b a").unwrap(), vec![2, 3, 1]);
}

#[test]
fn char_tokenizer_rejects_bad_vocabularies() {
    let dir = tempfile::tempdir().unwrap();
    assert!(write_char_tokenizer(dir.path(), "0123", &[]).is_err(), "no eos");
    assert!(
        write_char_tokenizer(dir.path(), "", &["<eos>"]).is_err(),
        "no characters"
    );
    let err = write_char_tokenizer(dir.path(), "0120", &["<eos>"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"0\"") && err.contains("twice"), "{err}");
}

#[test]
fn arith_defaults_and_vocabulary() {
    let task = ArithTask::default();
    assert_eq!((task.min_digits, task.max_digits, task.ops.clone()), (1, 2, vec!['+']));
    assert_eq!(task.vocab_chars(), "0123456789+=");
    assert_eq!(task.num_prompts(), 10_000);
    assert_eq!((task.max_prompt_len(), task.max_answer_len()), (6, 3));
    let all = ArithTask {
        min_digits: 2,
        max_digits: 3,
        ops: vec!['*', '-', '+'],
    };
    assert_eq!(all.vocab_chars(), "0123456789+-*=");
    assert_eq!(all.num_prompts(), 3 * 990 * 990);
    assert_eq!((all.max_prompt_len(), all.max_answer_len()), (8, 6));

    for bad in [
        ArithTask {
            min_digits: 0,
            ..ArithTask::default()
        },
        ArithTask {
            min_digits: 3,
            max_digits: 2,
            ..ArithTask::default()
        },
        ArithTask {
            max_digits: 10,
            ..ArithTask::default()
        },
        ArithTask {
            ops: vec![],
            ..ArithTask::default()
        },
        ArithTask {
            ops: vec!['/'],
            ..ArithTask::default()
        },
        ArithTask {
            ops: vec!['+', '+'],
            ..ArithTask::default()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

#[test]
fn arith_samples_are_deterministic_right_and_in_range() {
    let task = ArithTask {
        min_digits: 2,
        max_digits: 3,
        ops: vec!['+', '-', '*'],
    };
    let draw = |seed| {
        let mut rng = Rng::new(seed);
        (0..2000).map(|_| task.sample(&mut rng)).collect::<Vec<_>>()
    };
    let samples = draw(7);
    assert_eq!(samples, draw(7), "same seed, same samples");
    assert_ne!(samples, draw(8));

    let mut ops_seen = HashSet::new();
    let mut digits_seen = HashSet::new();
    let mut negative = false;
    for (prompt, answer) in &samples {
        let (a, op, b, value) = evaluate(prompt);
        assert_eq!(answer, &value.to_string(), "{prompt}");
        for x in [a, b] {
            assert!(x >= 0 && (2..=3).contains(&digits(x)), "{prompt}: operand {x}");
            digits_seen.insert(digits(x));
        }
        ops_seen.insert(op);
        negative |= answer.starts_with('-');
        assert!(prompt
            .chars()
            .chain(answer.chars())
            .all(|c| task.vocab_chars().contains(c)));
        assert!(prompt.len() <= task.max_prompt_len() && answer.len() <= task.max_answer_len());
    }
    assert_eq!(ops_seen.len(), 3);
    assert_eq!(digits_seen, HashSet::from([2, 3]));
    assert!(
        negative,
        "subtraction keeps operand order, so some answers are negative"
    );

    // Single digits include 0.
    let one = ArithTask {
        min_digits: 1,
        max_digits: 1,
        ops: vec!['-'],
    };
    let mut rng = Rng::new(0);
    let zeros = (0..500).filter(|_| evaluate(&one.sample(&mut rng).0).0 == 0).count();
    assert!(zeros > 20, "0 is a 1-digit operand ({zeros} of 500)");
}

#[test]
fn write_task_files_are_disjoint_and_load_as_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let task = ArithTask::default();
    let files = write_task(dir.path(), &task, 3000, 200, 1234).unwrap();
    assert_eq!(files.tokenizer_dir, dir.path().join("tokenizer"));
    assert!(files.tokenizer_dir.join("tokenizer.json").exists());
    assert_eq!((files.eos_token_id, files.pad_token_id, files.vocab_size), (0, 1, 14));

    let train = read_rows(&files.train);
    let eval = read_rows(&files.eval);
    assert_eq!((train.len(), eval.len()), (3000, 200));
    let train_prompts: HashSet<&str> = train.iter().map(|(p, _)| p.as_str()).collect();
    let eval_prompts: HashSet<&str> = eval.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!((train_prompts.len(), eval_prompts.len()), (3000, 200), "unique prompts");
    assert!(train_prompts.is_disjoint(&eval_prompts));
    for (prompt, answer) in train.iter().chain(&eval) {
        let (a, op, b, value) = evaluate(prompt);
        assert_eq!(op, '+');
        assert!((1..=2).contains(&digits(a)) && (1..=2).contains(&digits(b)), "{prompt}");
        assert_eq!(answer, &value.to_string(), "{prompt}");
    }

    // Same seed, same bytes; the eval set does not depend on n_train.
    let again = tempfile::tempdir().unwrap();
    let files2 = write_task(again.path(), &task, 500, 200, 1234).unwrap();
    assert_eq!(
        std::fs::read(&files.eval).unwrap(),
        std::fs::read(&files2.eval).unwrap()
    );
    assert_eq!(read_rows(&files2.train)[..], train[..500]);
    let other = write_task(again.path(), &task, 500, 200, 99).unwrap();
    assert_ne!(read_rows(&other.eval), eval);

    // The files load as prompt data with `--label-key label`, and the labels score 1.
    let tok = Tokenizer::from_dir(&files.tokenizer_dir).unwrap();
    let args = DataArgs {
        label_key: Some("label".into()),
        ..Default::default()
    };
    let ds = PromptDataset::load(&files.eval, &args, &tok).unwrap();
    assert_eq!(ds.len(), 200);
    for (s, (prompt, answer)) in ds.samples().iter().zip(&eval) {
        assert_eq!(&s.prompt, prompt);
        assert_eq!(s.prompt_ids.len(), prompt.len(), "one token per character");
        assert_eq!(tok.decode(&s.prompt_ids, false).unwrap(), *prompt);
        assert_eq!(s.label_text().as_deref(), Some(answer.as_str()));
        let reward = rule_reward("exact_match".parse().unwrap(), &format!("{answer}\n"), Some(answer)).unwrap();
        assert_eq!(reward, Reward::Scalar(1.0));
    }
    assert_eq!(PromptDataset::load(&files.train, &args, &tok).unwrap().len(), 3000);
}

#[test]
fn write_dataset_excludes_and_refuses_impossible_requests() {
    let dir = tempfile::tempdir().unwrap();
    let task = ArithTask {
        min_digits: 1,
        max_digits: 1,
        ops: vec!['+'],
    };
    // All 100 prompts, minus the 10 excluded ones.
    let exclude: HashSet<String> = (0..10).map(|b| format!("3+{b}=")).collect();
    let path = dir.path().join("all.jsonl");
    let prompts = task.write_dataset(&path, 90, 5, &exclude).unwrap();
    let unique: HashSet<&String> = prompts.iter().collect();
    assert_eq!(unique.len(), 90);
    assert!(prompts.iter().all(|p| !exclude.contains(p)));
    assert_eq!(read_rows(&path).len(), 90);
    assert!(
        std::fs::read_dir(dir.path()).unwrap().count() == 1,
        "no temporary file is left behind"
    );

    let err = task
        .write_dataset(&path, 101, 5, &HashSet::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("only 100 distinct prompts"), "{err}");
    let err = task.write_dataset(&path, 91, 5, &exclude).unwrap_err().to_string();
    assert!(
        err.contains("only 90 distinct prompts outside the 10 excluded"),
        "{err}"
    );
}
