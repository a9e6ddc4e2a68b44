//! Number keys switch tabs (or say why not), `?` lists every key of the
//! screen, and every screen's footer shows its keys, all from the one table
//! in `tui::keys`.

use super::*;
use crate::tui::keys;

#[test]
fn number_keys_switch_tabs_or_say_why_not() {
    let mut a = app(true);
    key(&mut a, KeyCode::Char('2'));
    assert_eq!(a.screen, Screen::Hardware);
    key(&mut a, KeyCode::Char('3'));
    assert_eq!(a.screen, Screen::Hardware);
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("choose a model first"),
        "{:?}",
        a.message
    );
    let s = screen_text(&a, 100, 24);
    assert!(
        s.contains("choose a model first"),
        "the reason is shown\n{s}"
    );
    key(&mut a, KeyCode::Char('5'));
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("nothing launched yet")
    );
    key(&mut a, KeyCode::Char('1'));
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.screen, Screen::Hardware);
    key(&mut a, KeyCode::Char('3'));
    assert_eq!(a.screen, Screen::Options);
    key(&mut a, KeyCode::Char('4'));
    assert_eq!(a.screen, Screen::Summary);
    // Invalid options keep the summary out of reach, with the reason.
    key(&mut a, KeyCode::Char('3'));
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "999999");
    key(&mut a, KeyCode::Enter);
    key(&mut a, KeyCode::Char('4'));
    assert_eq!(a.screen, Screen::Options);
    let m = a.message.clone().unwrap();
    assert!(
        m.contains("the summary needs valid options") && m.contains("40960"),
        "{m}"
    );
}

#[test]
fn number_keys_type_while_editing() {
    let mut a = app(true);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter]);
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "12345");
    assert_eq!(a.screen, Screen::Options);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.context_length, Some(12345));
}

#[test]
fn tabs_stay_reachable_while_running_but_a_second_launch_is_refused() {
    let mut a = launched(true);
    ready(&mut a);
    key(&mut a, KeyCode::Char('b'));
    assert_eq!(a.screen, Screen::Run);
    assert!(a.message.as_deref().unwrap().contains("s stops it"));
    key(&mut a, KeyCode::Char('4'));
    assert_eq!(a.screen, Screen::Summary);
    assert!(key(&mut a, KeyCode::Enter).is_empty());
    assert!(a.message.as_deref().unwrap().contains("already running"));
    key(&mut a, KeyCode::Char('5'));
    assert_eq!(a.screen, Screen::Run);
    assert!(a.runtime_active());
}

#[test]
fn help_overlay_lists_every_key_of_the_screen_and_closes() {
    let mut a = launched(true);
    for s in Screen::ALL {
        a.screen = s;
        key(&mut a, KeyCode::Char('?'));
        assert!(a.help, "? opens the overlay on {s:?}");
        let text = screen_text(&a, 120, 40);
        assert!(text.contains("Keys (Esc or ? closes)"), "{text}");
        for b in keys::screen(s).iter().chain(keys::GLOBAL) {
            assert!(
                text.contains(b.label) && text.contains(b.help),
                "{s:?}: {} ({}) not in the overlay\n{text}",
                b.label,
                b.help
            );
        }
        // Keys do nothing else while it is open; Esc or ? closes it.
        let before = a.screen;
        assert!(key(&mut a, KeyCode::Char('s')).is_empty());
        key(&mut a, KeyCode::Char('1'));
        assert_eq!(a.screen, before);
        key(
            &mut a,
            if s == Screen::Run {
                KeyCode::Esc
            } else {
                KeyCode::Char('?')
            },
        );
        assert!(!a.help);
        assert!(!screen_text(&a, 120, 40).contains("Keys (Esc or ? closes)"));
    }
}

#[test]
fn every_screen_lists_its_keys_in_the_footer() {
    let mut a = launched(true);
    for (s, own) in [
        (Screen::Model, "Enter choose"),
        (Screen::Hardware, "Enter options"),
        (Screen::Options, "Tab summary"),
        (Screen::Summary, "p save profile"),
        (Screen::Run, "w wrap"),
    ] {
        a.screen = s;
        let text = screen_text(&a, 120, 40);
        for hint in [own, "1-5 tabs", "? help", "q quit"] {
            assert!(text.contains(hint), "{s:?} footer lacks {hint:?}\n{text}");
        }
        // At 80 columns the hints wrap instead of being cut.
        let narrow = screen_text(&a, 80, 24);
        assert!(
            narrow.contains("q quit") && narrow.contains(own),
            "{narrow}"
        );
    }
    a.screen = Screen::Options;
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    let text = screen_text(&a, 120, 40);
    assert!(text.contains("Enter accept  Esc cancel"), "{text}");
}
