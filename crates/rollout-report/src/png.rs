//! PNG copies of the report's charts (`rollout report --png`): each chart's SVG, the same
//! one the page holds, rasterised in-process by resvg (usvg parses, tiny-skia draws) at
//! [`SCALE`] pixels per SVG unit. Labels are drawn with the system's fonts, found once per
//! report; without any, the charts are drawn without their text.

use std::path::{Path, PathBuf};

use resvg::tiny_skia::{Pixmap, Transform};
use resvg::usvg::{self, fontdb};

/// Pixels per SVG unit: a chart 640 units wide becomes 1280 pixels, sharp on a high-density
/// screen or a slide.
pub const SCALE: f32 = 2.0;

/// Sans-serif families preferred for labels, the first installed one wins (else any family).
const SANS_SERIF: [&str; 8] = [
    "DejaVu Sans",
    "Liberation Sans",
    "Noto Sans",
    "Roboto",
    "Helvetica Neue",
    "Helvetica",
    "Arial",
    "FreeSans",
];

#[derive(Debug, thiserror::Error)]
pub enum PngError {
    #[error("the chart's SVG cannot be read")]
    Svg(#[source] usvg::Error),
    #[error("a chart of {width}x{height} pixels cannot be drawn")]
    Size { width: f32, height: f32 },
    #[error("the PNG cannot be encoded")]
    Encode(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Draws SVGs into pixels, with one font database shared by every chart.
pub struct Rasterizer {
    options: usvg::Options<'static>,
}

impl Rasterizer {
    /// With the system's fonts (fontconfig's directories and the usual font folders).
    pub fn with_system_fonts() -> Self {
        let mut database = fontdb::Database::new();
        database.load_system_fonts();
        Self::with_fonts(database)
    }

    /// With the fonts of `database` (none: text is left out, everything else drawn).
    pub fn with_fonts(database: fontdb::Database) -> Self {
        let mut options = usvg::Options::default();
        // The charts name no font: usvg draws their text in this family.
        if let Some(family) = label_family(&database) {
            options.font_family = family;
        }
        options.fontdb = std::sync::Arc::new(database);
        Self { options }
    }

    /// How many font faces labels can be drawn with.
    pub fn font_faces(&self) -> usize {
        self.options.fontdb.len()
    }

    /// `svg` drawn at [`SCALE`].
    pub fn pixmap(&self, svg: &str) -> Result<Pixmap, PngError> {
        let tree = usvg::Tree::from_str(svg, &self.options).map_err(PngError::Svg)?;
        let size = tree.size();
        let (width, height) = (size.width() * SCALE, size.height() * SCALE);
        let mut pixmap = Pixmap::new(width.ceil() as u32, height.ceil() as u32)
            .ok_or(PngError::Size { width, height })?;
        resvg::render(
            &tree,
            Transform::from_scale(SCALE, SCALE),
            &mut pixmap.as_mut(),
        );
        Ok(pixmap)
    }

    /// `svg` drawn at [`SCALE`], as the bytes of a PNG file.
    pub fn png(&self, svg: &str) -> Result<Vec<u8>, PngError> {
        self.pixmap(svg)?
            .encode_png()
            .map_err(|err| PngError::Encode(Box::new(err)))
    }
}

/// The family labels are drawn in: the first of [`SANS_SERIF`] installed, else the first
/// family by name; `None` without fonts.
fn label_family(database: &fontdb::Database) -> Option<String> {
    let mut families: Vec<&str> = database
        .faces()
        .flat_map(|face| face.families.iter().map(|(name, _)| name.as_str()))
        .collect();
    families.sort_unstable();
    SANS_SERIF
        .iter()
        .find(|wanted| families.binary_search(wanted).is_ok())
        .map(|name| (*name).to_owned())
        .or_else(|| families.first().map(|name| (*name).to_owned()))
}

/// Where `--png` puts the charts of the page `html`: beside it, in `<stem>_files/`
/// (`runs/a/report.html` → `runs/a/report_files/`), as a browser saves a page's files.
pub fn default_dir(html: &Path) -> PathBuf {
    let stem = html
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_else(|| "report".to_owned());
    html.with_file_name(format!("{stem}_files"))
}
