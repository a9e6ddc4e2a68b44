//! The request's tool declarations, used to give XML parameter values (which
//! are always text) the JSON types the tool's schema asks for.

use serde_json::{Map, Value};

/// Tools declared by the request: name -> JSON schema of the parameters.
#[derive(Debug, Clone, Default)]
pub struct ToolSet {
    tools: Vec<(String, Value)>,
}

impl ToolSet {
    /// From OpenAI `tools` entries (`{"type":"function","function":{...}}`).
    pub fn from_openai(tools: &[Value]) -> Self {
        let tools = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                let name = f.get("name")?.as_str()?.to_string();
                let params = f.get("parameters").cloned().unwrap_or(Value::Null);
                Some((name, params))
            })
            .collect();
        ToolSet { tools }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tools.iter().any(|(n, _)| n == name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.iter().map(|(n, _)| n.as_str())
    }

    /// Each tool's name and parameters schema, in declaration order (a
    /// tool that declares none takes any object).
    pub fn schemas(&self) -> impl Iterator<Item = (&str, Value)> {
        self.tools.iter().map(|(n, s)| {
            let s = match s {
                Value::Null => serde_json::json!({"type": "object"}),
                s => s.clone(),
            };
            (n.as_str(), s)
        })
    }

    /// The declared JSON types of one parameter (empty when undeclared).
    fn param_types(&self, tool: &str, param: &str) -> Vec<String> {
        let Some((_, schema)) = self.tools.iter().find(|(n, _)| n == tool) else {
            return Vec::new();
        };
        let Some(prop) = schema.get("properties").and_then(|p| p.get(param)) else {
            return Vec::new();
        };
        let mut types = Vec::new();
        collect_types(prop, &mut types);
        types
    }

    /// Converts a textual parameter value to the declared type. A value that
    /// does not fit any declared type stays a string, so the client's own
    /// validation reports it to the model (the usual agent-loop recovery).
    pub fn convert(&self, tool: &str, param: &str, raw: &str) -> Value {
        let types = self.param_types(tool, param);
        for t in types.iter().filter(|t| t.as_str() != "string") {
            if let Some(v) = convert_as(t, raw) {
                return v;
            }
        }
        if !types.is_empty() && !types.iter().any(|t| t == "string") {
            tracing::warn!(
                tool,
                param,
                ?types,
                "tool parameter value does not match its schema; passing it as a string"
            );
        }
        Value::String(raw.to_string())
    }
}

fn collect_types(schema: &Value, out: &mut Vec<String>) {
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.clone()),
        Some(Value::Array(ts)) => {
            out.extend(ts.iter().filter_map(|t| t.as_str().map(String::from)))
        }
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            for alt in alts {
                collect_types(alt, out);
            }
        }
    }
    if out.is_empty() && schema.get("enum").is_some() {
        out.push("string".into());
    }
}

fn convert_as(ty: &str, raw: &str) -> Option<Value> {
    let t = raw.trim();
    match ty {
        "integer" => t.parse::<i64>().ok().map(Value::from),
        "number" => {
            if let Ok(i) = t.parse::<i64>() {
                Some(Value::from(i))
            } else {
                t.parse::<f64>()
                    .ok()
                    .and_then(serde_json::Number::from_f64)
                    .map(Value::Number)
            }
        }
        "boolean" => match t.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "null" => (t == "null" || t == "None").then_some(Value::Null),
        "object" => match serde_json::from_str::<Value>(t) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => None,
        },
        "array" => match serde_json::from_str::<Value>(t) {
            Ok(v @ Value::Array(_)) => Some(v),
            _ => None,
        },
        _ => None,
    }
}

/// Builds the arguments object string from converted parameters.
pub fn arguments_string(params: Map<String, Value>) -> String {
    Value::Object(params).to_string()
}
