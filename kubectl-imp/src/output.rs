//! Tables by default, `-o json|yaml` for scripts.

use serde::Serialize;

use crate::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

/// `rows` (the first is the header) as left-aligned columns separated by three spaces, like kubectl.
pub fn columns<const N: usize>(rows: &[[String; N]]) -> String {
    let mut width = [0usize; N];
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}   ", w = width[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `value` as `format`; `table` renders it for people.
pub fn render<T: Serialize>(
    format: Format,
    value: &T,
    table: impl FnOnce(&T) -> String,
) -> Result<String, Error> {
    Ok(match format {
        Format::Table => table(value),
        Format::Json => serde_json::to_string_pretty(value).map_err(Error::Json)? + "\n",
        Format::Yaml => serde_yaml::to_string(value).map_err(Error::Yaml)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_the_last_one_is_not_padded() {
        let rows = [
            ["NAME".to_owned(), "AGE".to_owned()],
            ["a-long-name".to_owned(), "1s".to_owned()],
        ];
        assert_eq!(columns(&rows), "NAME          AGE\na-long-name   1s\n");
    }
}
