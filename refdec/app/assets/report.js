// decode.py --html: the page's script (refdec/app/htmlreport.py inlines it in every page): the search box,
// the menu of sentences where a run differs from greedy, and links to a sentence.
(function () {
  var q = document.getElementById('q'), only = document.getElementById('only'), count = document.getElementById('count');
  var sents = Array.prototype.slice.call(document.querySelectorAll('.sent'));
  var texts = sents.map(function (s) {
    return Array.prototype.map.call(s.querySelectorAll('.src, .ref, .out'), function (x) { return x.textContent; })
      .join('\n').toLowerCase();
  });
  var differs = sents.map(function (s) { return JSON.parse(s.getAttribute('data-differs')); });
  function update() {
    var words = q.value.toLowerCase().split(/\s+/).filter(Boolean), want = only.value, shown = 0;
    sents.forEach(function (s, i) {
      var ok = words.every(function (w) { return texts[i].indexOf(w) >= 0; }) &&
               (!want || (want === '*' ? differs[i].length > 0 : differs[i].indexOf(want) >= 0));
      s.classList.toggle('hidden', !ok);
      if (ok) shown++;
    });
    count.textContent = shown + ' of ' + sents.length + ' sentences';
  }
  // A link to a sentence (#s78, the lossless checks' "line 78"): clear a search or menu that hides
  // it, open every run's decoding, mark it, and bring it into view below the sticky search bar.
  function reveal() {
    var m = /^#s(\d+)$/.exec(location.hash), target = m && document.getElementById('s' + m[1]);
    sents.forEach(function (s) { s.classList.toggle('linked', s === target); });
    if (!target) return;
    if (target.classList.contains('hidden')) { q.value = ''; only.value = ''; update(); }
    Array.prototype.forEach.call(target.querySelectorAll('details'), function (d) { d.open = true; });
    target.scrollIntoView();
  }
  q.addEventListener('input', update);
  only.addEventListener('change', update);
  window.addEventListener('hashchange', reveal);
  update();
  reveal();
})();
