//! A model's shape from its Hugging Face `config.json`, and its parameter counts by formula.
//!
//! Llama-style decoders (Llama, Mistral, Mixtral, Qwen2, Qwen3 and anything else that names
//! its fields the same way) and GPT-2 are understood; nothing but the JSON is read.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::PlanError;

/// How a decoder layer is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// RMSNorm, rotary positions, separate q/k/v/o projections, gated MLP (gate/up/down).
    Llama,
    /// LayerNorm with biases, learned positions, fused `c_attn`, two-matrix MLP, biases.
    Gpt2,
}

/// What the planner needs to know about a model.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelShape {
    pub model_type: String,
    pub architecture: Architecture,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub intermediate_size: u64,
    pub vocab_size: u64,
    pub max_positions: u64,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// RMSNorms on queries and keys (Qwen3).
    pub qk_norm: bool,
    /// Mixture-of-experts MLPs per layer (Mixtral's `num_local_experts`); 1 is dense.
    pub experts: u64,
    /// A sequence classifier (`*ForSequenceClassification`, as reward models are): its head
    /// maps the hidden state to this many labels instead of the vocabulary.
    pub classifier_labels: Option<u64>,
}

/// Parameters by part of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct ParameterCounts {
    /// Token embeddings, and GPT-2's position embeddings.
    pub embedding: u64,
    /// Every decoder layer together.
    pub layers: u64,
    /// The weight matrices of the decoder layers' linear projections (what int8/nf4
    /// quantization replaces); part of `layers`.
    pub layer_linear_weights: u64,
    pub final_norm: u64,
    /// The output projection; 0 when tied to the embeddings.
    pub lm_head: u64,
}

impl ParameterCounts {
    pub fn total(&self) -> u64 {
        self.embedding
            .saturating_add(self.layers)
            .saturating_add(self.final_norm)
            .saturating_add(self.lm_head)
    }
}

/// One linear projection of a decoder layer: its name as PEFT matches it, and its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linear {
    pub name: &'static str,
    pub in_features: u64,
    pub out_features: u64,
}

impl ModelShape {
    /// Reads `dir/config.json`; a `dir` that is a hub id (`org/name`) not on disk is read
    /// from the local Hugging Face cache (see [`super::hub_cache`]).
    pub fn read(dir: &Path) -> Result<Self, PlanError> {
        let path = super::hub_cache::resolve(dir).join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| PlanError::ModelConfig {
            path: path.clone(),
            message: source.to_string(),
        })?;
        Self::parse(&path, &text)
    }

    /// Parses the text of a `config.json`; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, PlanError> {
        let root: Value = serde_json::from_str(text).map_err(|err| PlanError::ModelConfig {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {err}"),
        })?;
        // Multimodal configs keep the language model's fields in `text_config`.
        let config = match root.get("text_config") {
            Some(text_config) if text_config.is_object() => text_config,
            _ => &root,
        };
        let fields = Fields {
            path: path.to_path_buf(),
            config,
        };
        let model_type = fields
            .string("model_type")
            .or_else(|| root.get("model_type").and_then(Value::as_str))
            .unwrap_or("unknown")
            .to_owned();
        let mut shape = if model_type == "gpt2" || config.get("n_embd").is_some() {
            fields.gpt2(model_type)?
        } else {
            fields.llama(model_type)?
        };
        shape.classifier_labels = classifier_labels(&root);
        Ok(shape)
    }

    /// Parameter counts by the architecture's formulas.
    pub fn parameters(&self) -> ParameterCounts {
        let h = self.hidden_size;
        let linear_weights: u64 = self
            .linears()
            .iter()
            .map(|l| l.in_features * l.out_features)
            .sum::<u64>()
            + self.extra_expert_weights();
        let per_layer = linear_weights + self.layer_biases_and_norms();
        let layers = |n: u64| n.saturating_mul(self.num_layers);
        let (embedding, final_norm) = match self.architecture {
            Architecture::Llama => (self.vocab_size * h, h),
            Architecture::Gpt2 => ((self.vocab_size + self.max_positions) * h, 2 * h),
        };
        ParameterCounts {
            embedding,
            layers: layers(per_layer),
            layer_linear_weights: layers(linear_weights),
            final_norm,
            lm_head: match self.classifier_labels {
                // `score`: a linear layer without bias.
                Some(labels) => labels * h,
                None if self.tie_word_embeddings => 0,
                None => self.vocab_size * h,
            },
        }
    }

    /// The linear projections of one layer (one expert's MLP for mixtures of experts).
    pub fn linears(&self) -> Vec<Linear> {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let i = self.intermediate_size;
        let linear = |name, in_features, out_features| Linear {
            name,
            in_features,
            out_features,
        };
        match self.architecture {
            Architecture::Llama => vec![
                linear("q_proj", h, q),
                linear("k_proj", h, kv),
                linear("v_proj", h, kv),
                linear("o_proj", q, h),
                linear("gate_proj", h, i),
                linear("up_proj", h, i),
                linear("down_proj", i, h),
            ],
            Architecture::Gpt2 => vec![
                linear("c_attn", h, 3 * h),
                linear("c_proj", h, h),
                linear("c_fc", h, i),
                linear("c_proj", i, h),
            ],
        }
    }

    /// Weights of the experts beyond the first, and the router, per layer.
    fn extra_expert_weights(&self) -> u64 {
        if self.experts <= 1 {
            return 0;
        }
        let mlp = 3 * self.hidden_size * self.intermediate_size;
        (self.experts - 1) * mlp + self.hidden_size * self.experts
    }

    fn layer_biases_and_norms(&self) -> u64 {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        match self.architecture {
            Architecture::Llama => {
                let qkv = if self.qkv_bias { q + 2 * kv } else { 0 };
                let o = if self.o_bias { h } else { 0 };
                let mlp = if self.mlp_bias {
                    (2 * self.intermediate_size + h) * self.experts
                } else {
                    0
                };
                let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
                2 * h + qkv + o + mlp + qk_norm
            }
            // Two LayerNorms (weight and bias) and the biases of c_attn, c_proj, c_fc, c_proj.
            Architecture::Gpt2 => 4 * h + 3 * h + h + self.intermediate_size + h,
        }
    }

    /// Elements of one token's keys and values over all layers.
    pub fn kv_elements_per_token(&self) -> u64 {
        (2 * self.num_layers * self.num_kv_heads).saturating_mul(self.head_dim)
    }
}

/// The labels of a `*ForSequenceClassification` model: `num_labels`, else the size of
/// `id2label`, else transformers' default of 2. `None` for any other architecture.
fn classifier_labels(root: &Value) -> Option<u64> {
    let classifier = root
        .get("architectures")?
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .any(|name| name.ends_with("ForSequenceClassification"));
    if !classifier {
        return None;
    }
    let labels = root
        .get("num_labels")
        .and_then(Value::as_u64)
        .or_else(|| Some(root.get("id2label")?.as_object()?.len() as u64))
        .unwrap_or(2);
    Some(labels.clamp(1, MAX_DIMENSION))
}

/// The largest size of any dimension believed (larger ones are errors, so that the
/// formulas cannot overflow: layer and expert counts are capped lower still).
const MAX_DIMENSION: u64 = 1 << 24;
const MAX_LAYERS: u64 = 1 << 16;
const MAX_EXPERTS: u64 = 1 << 10;

/// Typed access to a config's fields, with errors naming the file and the field.
struct Fields<'a> {
    path: PathBuf,
    config: &'a Value,
}

impl Fields<'_> {
    fn string(&self, key: &str) -> Option<&str> {
        self.config.get(key).and_then(Value::as_str)
    }

    /// The first of `keys` present (and not null) as a positive integer.
    fn optional(&self, keys: &[&str]) -> Result<Option<u64>, PlanError> {
        for key in keys {
            match self.config.get(*key) {
                None | Some(Value::Null) => continue,
                Some(value) => {
                    return match value.as_u64() {
                        Some(n) if n > 0 && n <= MAX_DIMENSION => Ok(Some(n)),
                        _ => Err(PlanError::ModelConfig {
                            path: self.path.clone(),
                            message: format!(
                                "`{key}` must be a positive integer up to {MAX_DIMENSION}, got {value}"
                            ),
                        }),
                    };
                }
            }
        }
        Ok(None)
    }

    fn required(&self, keys: &[&str]) -> Result<u64, PlanError> {
        self.optional(keys)?.ok_or_else(|| PlanError::ModelConfig {
            path: self.path.clone(),
            message: format!("has no `{}`", keys.join("` or `")),
        })
    }

    fn at_most(&self, value: u64, max: u64, key: &str) -> Result<u64, PlanError> {
        if value <= max {
            Ok(value)
        } else {
            Err(PlanError::ModelConfig {
                path: self.path.clone(),
                message: format!("`{key}` = {value} is more than {max}"),
            })
        }
    }

    fn flag(&self, key: &str, default: bool) -> bool {
        self.config
            .get(key)
            .and_then(Value::as_bool)
            .unwrap_or(default)
    }

    fn llama(&self, model_type: String) -> Result<ModelShape, PlanError> {
        let hidden_size = self.required(&["hidden_size", "d_model"])?;
        let num_heads = self.required(&["num_attention_heads"])?;
        let head_dim = self
            .optional(&["head_dim"])?
            .unwrap_or(hidden_size / num_heads);
        let attention_bias = self.flag("attention_bias", false);
        // Qwen2 always has q/k/v biases; PretrainedConfig ties embeddings by default, the
        // Llama-family configs do not.
        let qwen2 = model_type.starts_with("qwen2");
        let untied_by_default = [
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen3",
            "qwen2_moe",
            "qwen3_moe",
        ]
        .contains(&model_type.as_str());
        Ok(ModelShape {
            architecture: Architecture::Llama,
            hidden_size,
            num_layers: self.at_most(
                self.required(&["num_hidden_layers", "num_layers"])?,
                MAX_LAYERS,
                "num_hidden_layers",
            )?,
            num_heads,
            num_kv_heads: self
                .optional(&["num_key_value_heads"])?
                .unwrap_or(num_heads),
            head_dim,
            intermediate_size: self
                .optional(&["intermediate_size", "ffn_dim"])?
                .unwrap_or(4 * hidden_size),
            vocab_size: self.required(&["vocab_size"])?,
            max_positions: self
                .optional(&["max_position_embeddings", "seq_length"])?
                .unwrap_or(4096),
            tie_word_embeddings: self.flag("tie_word_embeddings", !untied_by_default),
            qkv_bias: qwen2 || attention_bias,
            o_bias: attention_bias && !qwen2,
            mlp_bias: self.flag("mlp_bias", false),
            qk_norm: model_type.starts_with("qwen3"),
            experts: self.at_most(
                self.optional(&["num_local_experts"])?.unwrap_or(1),
                MAX_EXPERTS,
                "num_local_experts",
            )?,
            classifier_labels: None,
            model_type,
        })
    }

    fn gpt2(&self, model_type: String) -> Result<ModelShape, PlanError> {
        let hidden_size = self.required(&["n_embd", "hidden_size"])?;
        let num_heads = self.required(&["n_head", "num_attention_heads"])?;
        Ok(ModelShape {
            model_type,
            architecture: Architecture::Gpt2,
            hidden_size,
            num_layers: self.at_most(
                self.required(&["n_layer", "num_hidden_layers"])?,
                MAX_LAYERS,
                "n_layer",
            )?,
            num_heads,
            num_kv_heads: num_heads,
            head_dim: hidden_size / num_heads,
            intermediate_size: self.optional(&["n_inner"])?.unwrap_or(4 * hidden_size),
            vocab_size: self.required(&["vocab_size"])?,
            max_positions: self.optional(&["n_positions", "n_ctx"])?.unwrap_or(1024),
            tie_word_embeddings: self.flag("tie_word_embeddings", true),
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            qk_norm: false,
            experts: 1,
            classifier_labels: None,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> ModelShape {
        ModelShape::parse(Path::new("config.json"), text).unwrap()
    }

    /// The quickstart bench's "small" Llama: hidden 512, 8 layers, 8 heads, MLP 1376, 56 tokens.
    const SMALL_LLAMA: &str = r#"{"model_type": "llama", "hidden_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 1376, "vocab_size": 56,
        "max_position_embeddings": 128, "tie_word_embeddings": false,
        "attention_bias": false, "mlp_bias": false}"#;

    #[test]
    fn llama_counts_match_the_formula() {
        let shape = parse(SMALL_LLAMA);
        let (h, i, v, layers) = (512u64, 1376u64, 56u64, 8u64);
        let per_layer = 4 * h * h + 3 * h * i + 2 * h;
        let params = shape.parameters();
        assert_eq!(params.layers, layers * per_layer);
        assert_eq!(
            params.layer_linear_weights,
            layers * (4 * h * h + 3 * h * i)
        );
        // 25,362,944 is what `sum(p.numel())` reports for this model in torch.
        assert_eq!(params.total(), v * h + layers * per_layer + h + v * h);
        assert_eq!(params.total(), 25_362_944);
        assert_eq!(shape.kv_elements_per_token(), 2 * 8 * 8 * 64);
    }

    #[test]
    fn llama_7b_is_6_74_billion() {
        let shape = parse(
            r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}"#,
        );
        assert!(!shape.tie_word_embeddings);
        assert_eq!(shape.parameters().total(), 6_738_415_616);
    }

    #[test]
    fn qwen2_has_qkv_biases_gqa_and_tied_embeddings() {
        // Qwen2.5-0.5B: 494,032,768 parameters.
        let shape = parse(
            r#"{"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
            "vocab_size": 151936, "tie_word_embeddings": true,
            "max_position_embeddings": 32768}"#,
        );
        assert!(shape.qkv_bias && !shape.o_bias);
        assert_eq!(shape.head_dim, 64);
        assert_eq!(shape.parameters().lm_head, 0);
        assert_eq!(shape.parameters().total(), 494_032_768);
        assert_eq!(shape.kv_elements_per_token(), 2 * 24 * 2 * 64);
    }

    #[test]
    fn mistral_7b_counts() {
        let shape = parse(
            r#"{"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 32000}"#,
        );
        assert_eq!(shape.parameters().total(), 7_241_732_096);
    }

    #[test]
    fn gpt2_names_and_tied_head() {
        // GPT-2 small: 124,439,808 parameters.
        let shape = parse(
            r#"{"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
            "n_inner": null, "vocab_size": 50257, "n_positions": 1024}"#,
        );
        assert_eq!(shape.architecture, Architecture::Gpt2);
        assert_eq!(shape.intermediate_size, 3072);
        assert!(shape.tie_word_embeddings);
        assert_eq!(shape.parameters().total(), 124_439_808);
    }

    #[test]
    fn bad_configs_are_errors_not_panics() {
        let path = Path::new("m/config.json");
        for text in [
            "",
            "[]",
            "{}",
            r#"{"hidden_size": "big"}"#,
            r#"{"hidden_size": 0, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 3}"#,
            r#"{"n_embd": -1}"#,
        ] {
            let err = ModelShape::parse(path, text).unwrap_err();
            assert!(err.to_string().contains("m/config.json"), "{err}");
        }
    }

    #[test]
    fn a_sequence_classifier_has_a_score_head_not_an_lm_head() {
        // The demo reward model: hidden 32, 2 layers, MLP 128, one label.
        let text = r#"{"architectures": ["LlamaForSequenceClassification"],
            "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 56,
            "id2label": {"0": "has_7"}, "tie_word_embeddings": false}"#;
        let shape = parse(text);
        assert_eq!(shape.classifier_labels, Some(1));
        let params = shape.parameters();
        assert_eq!(params.lm_head, 32);
        // 34,752 parameters, as torch counts them.
        assert_eq!(params.total(), 34_752);
        assert_eq!(parse(SMALL_LLAMA).classifier_labels, None);
    }

    #[test]
    fn multimodal_text_config_is_used() {
        let shape = parse(&format!(
            r#"{{"model_type": "llava", "text_config": {SMALL_LLAMA}}}"#
        ));
        assert_eq!(shape.model_type, "llama");
        assert_eq!(shape.parameters().total(), 25_362_944);
    }
}
