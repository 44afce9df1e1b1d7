//! The `f1` reward (slime's `rm_hub/f1.py`, SQuAD-style): token-level F1 between the response
//! and the label after lowercasing, dropping ASCII punctuation and the articles a/an/the.
//! A yes/no/noanswer answer on either side scores 0 unless both sides are identical.

use std::collections::HashMap;

/// SQuAD's `normalize_answer`.
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punc: String = lower.chars().filter(|c| !c.is_ascii_punctuation()).collect();
    // \b(a|an|the)\b -> " " (word characters are alphanumerics and `_`).
    let mut out = String::with_capacity(no_punc.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in no_punc.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `(f1, precision, recall)`; all zero when nothing overlaps.
pub fn f1_score(prediction: &str, ground_truth: &str) -> (f64, f64, f64) {
    let pred = normalize_answer(prediction);
    let gold = normalize_answer(ground_truth);
    let special = ["yes", "no", "noanswer"];
    if (special.contains(&pred.as_str()) || special.contains(&gold.as_str())) && pred != gold {
        return (0.0, 0.0, 0.0);
    }
    let pred_tokens: Vec<&str> = pred.split_whitespace().collect();
    let gold_tokens: Vec<&str> = gold.split_whitespace().collect();
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for t in &gold_tokens {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0i64;
    for t in &pred_tokens {
        if let Some(c) = counts.get_mut(t) {
            if *c > 0 {
                *c -= 1;
                same += 1;
            }
        }
    }
    if same == 0 {
        return (0.0, 0.0, 0.0);
    }
    let precision = same as f64 / pred_tokens.len() as f64;
    let recall = same as f64 / gold_tokens.len() as f64;
    (2.0 * precision * recall / (precision + recall), precision, recall)
}
