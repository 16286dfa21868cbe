#include "wsync/sources/layouts.hpp"

#include <algorithm>

namespace wsync {
namespace {

// The fields of a decoder-only transformer's config.json that fix its checkpoint layout.
struct decoder_config {
  const char* name;
  const char* description;
  std::int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool qkv_bias, tied_embeddings;
};

// From the models' published config.json files.
constexpr decoder_config configs[] = {
    {"qwen2.5-0.5b", "Qwen2.5-0.5B (bf16, tied embeddings)", 151936, 896, 4864, 24, 14, 2, 64, true,
     true},
    {"qwen2.5-1.5b", "Qwen2.5-1.5B (bf16, tied embeddings)", 151936, 1536, 8960, 28, 12, 2, 128,
     true, true},
    {"llama-3-8b", "Meta-Llama-3-8B (bf16)", 128256, 4096, 14336, 32, 32, 8, 128, false, false},
};

model_layout build(const decoder_config& c) {
  model_layout l{c.name, c.description, {}};
  auto add = [&](std::string name, std::vector<std::int64_t> shape) {
    l.tensors.push_back({std::move(name), dtype::bf16, std::move(shape)});
  };
  const std::int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  add("model.embed_tokens.weight", {c.vocab, c.hidden});
  for (std::int64_t i = 0; i < c.layers; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "self_attn.q_proj.weight", {q, c.hidden});
    if (c.qkv_bias) add(p + "self_attn.q_proj.bias", {q});
    add(p + "self_attn.k_proj.weight", {kv, c.hidden});
    if (c.qkv_bias) add(p + "self_attn.k_proj.bias", {kv});
    add(p + "self_attn.v_proj.weight", {kv, c.hidden});
    if (c.qkv_bias) add(p + "self_attn.v_proj.bias", {kv});
    add(p + "self_attn.o_proj.weight", {c.hidden, q});
    add(p + "mlp.gate_proj.weight", {c.intermediate, c.hidden});
    add(p + "mlp.up_proj.weight", {c.intermediate, c.hidden});
    add(p + "mlp.down_proj.weight", {c.hidden, c.intermediate});
    add(p + "input_layernorm.weight", {c.hidden});
    add(p + "post_attention_layernorm.weight", {c.hidden});
  }
  add("model.norm.weight", {c.hidden});
  if (!c.tied_embeddings) add("lm_head.weight", {c.vocab, c.hidden});
  return l;
}

}  // namespace

std::uint64_t layout_tensor::nbytes() const {
  std::uint64_t n = dtype_itemsize(dtype);
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

std::uint64_t model_layout::bytes() const {
  std::uint64_t n = 0;
  for (const auto& t : tensors) n += t.nbytes();
  return n;
}

std::vector<std::string> layout_names() {
  std::vector<std::string> names;
  for (const auto& c : configs) names.emplace_back(c.name);
  return names;
}

std::optional<model_layout> layout_find(std::string_view name) {
  for (const auto& c : configs) {
    if (name == c.name) return build(c);
  }
  return std::nullopt;
}

model_layout layout_synthetic(std::uint64_t bytes, std::uint64_t tensors) {
  constexpr std::int64_t row_elems = 2048;  // 4 KiB rows of bf16
  tensors = std::max<std::uint64_t>(tensors, 1);
  auto rows_total = std::max<std::uint64_t>(bytes / (row_elems * 2), tensors);
  model_layout l{"synthetic", "synthetic bf16 tensors", {}};
  for (std::uint64_t i = 0; i < tensors; ++i) {
    auto rows = rows_total / tensors + (i < rows_total % tensors ? 1 : 0);
    l.tensors.push_back({"synthetic.layers." + std::to_string(i) + ".weight",
                         dtype::bf16,
                         {static_cast<std::int64_t>(rows), row_elems}});
  }
  return l;
}

}  // namespace wsync
