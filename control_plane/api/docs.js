// Starts Swagger UI on /docs. A file of its own: the page's Content-Security-Policy allows
// scripts from this origin only, never inline ones.
"use strict";
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  // No badge from the public validator service: nothing leaves this origin.
  validatorUrl: null,
  oauth2RedirectUrl: window.location.origin + "/docs/oauth2-redirect",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
